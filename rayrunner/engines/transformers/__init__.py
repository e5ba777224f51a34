"""rayrunner's own engine: transformers' modelling run by a step loop (`step/`) within a KV budget (`kv/`)."""
