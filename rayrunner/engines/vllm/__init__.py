"""vLLM's engine inside a replica, and the interpreter it runs in."""
