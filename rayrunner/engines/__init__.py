"""The engines a model replica runs: the contract (`base`), the factory, loading, and rayrunner's own
(`transformers/`) and vLLM's (`vllm/`)."""
