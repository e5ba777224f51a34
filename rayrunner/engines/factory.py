"""The engine a model's replica runs, chosen from its spec: the seam where engines plug in.

`ModelServer` takes an `EngineFactory` (this module's `build_engine` in production). Imports are local, so a
replica loads only what its model needs and this module stays free of torch.
"""

from __future__ import annotations

from collections.abc import Callable

from rayrunner.engines.base import Engine
from rayrunner.models.spec import ModelSpec

EngineFactory = Callable[[ModelSpec], Engine]


def build_engine(spec: ModelSpec) -> Engine:
    """The engine for the spec's backend and kind (imports are local: a replica loads only what its model needs)."""
    if spec.engine.backend == "vllm":
        from rayrunner.engines.vllm.engine import VllmEngine

        return VllmEngine(spec)
    if spec.kind == "embedding":
        from rayrunner.engines.transformers.embedding import EmbeddingEngine

        return EmbeddingEngine(spec)
    if spec.kind == "multimodal":
        from rayrunner.engines.transformers.multimodal import MultimodalEngine

        return MultimodalEngine(spec)
    from rayrunner.engines.transformers.text import TextEngine

    return TextEngine(spec)
