"""What each Ray process sets up: transport, warm workers, preload, logs, metrics."""
