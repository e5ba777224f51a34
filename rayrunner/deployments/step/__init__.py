"""The engine's step loop: scheduler, sequences, KV batch, sampling, decoding."""
