"""What a model is: its spec, source and footprint (torch-free)."""
