"""Sentence embeddings from an encoder (or decoder) model, pooled the way its sentence-transformers config says.

The pooling is read from the model folder (`modules.json`, `1_Pooling/config.json`), so a sentence-transformers model
gives the same vectors here as in sentence-transformers itself, without depending on that package. A plain
transformers folder gets mean pooling. Forward passes run in a worker thread so the replica's event loop stays free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import torch
from transformers import AutoModel

from rayrunner.engines.base import Engine, EngineInfo, describe
from rayrunner.engines.loading import load_model
from rayrunner.engines.transformers.step.compute_thread import ComputeThread
from rayrunner.errors import ModelLoadError
from rayrunner.models.spec import ModelSpec
from rayrunner.openai.events import EmbeddingResult

T = TypeVar("T")

BATCH_SIZE = 32

PoolingMode = Literal["mean", "cls", "lasttoken"]
# sentence-transformers module types this engine reproduces; any other (e.g. Dense) would change the vectors.
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")
_ST_MODES: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
}


@dataclass(frozen=True)
class Pooling:
    """How token states become one vector."""

    mode: PoolingMode = "mean"
    normalize: bool = False


def read_pooling(folder: Path) -> Pooling:
    """The pooling a model folder asks for; mean without normalisation when it is not a sentence-transformers one."""
    modules = _read_json(folder / "modules.json") or []
    if not modules:
        return Pooling()
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    unknown = [k for k in kinds if k not in _KNOWN_MODULES]
    if unknown:
        raise ModelLoadError(f"sentence-transformers modules {unknown} are not supported (only {_KNOWN_MODULES})")
    pooling_dir = next((m.get("path", "") for m, k in zip(modules, kinds, strict=True) if k == "Pooling"), "")
    # A sentence-transformers model is compared by cosine; unit vectors make dot product agree with it.
    return Pooling(mode=_pooling_mode(folder / pooling_dir / "config.json"), normalize=True)


def _pooling_mode(config_path: Path) -> PoolingMode:
    config = _read_json(config_path) or {}
    chosen = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v and k not in _ST_MODES]
    if others:
        raise ModelLoadError(f"pooling {others} is not supported (only mean, cls and lasttoken)")
    return chosen[0] if chosen else "mean"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling: Pooling) -> torch.Tensor:
    """[batch, seq, dim] token states and [batch, seq] attention mask -> [batch, dim] float32 vectors."""
    hidden = hidden.float()
    if pooling.mode == "cls":
        vectors = hidden[:, 0]
    elif pooling.mode == "lasttoken":
        # Position of the last real token, whichever side the tokenizer pads on.
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (mask * positions).argmax(dim=1)
        vectors = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    else:
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        vectors = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
    return torch.nn.functional.normalize(vectors, p=2, dim=1) if pooling.normalize else vectors


class EmbeddingEngine(Engine):
    """One embedding model; serves `embed` only (chat and completions refuse with a 400)."""

    kind = "embedding"

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.compute = ComputeThread("embedding-engine", spec.engine.torch_threads)
        self.loaded = self.compute.call(load_model, spec, AutoModel)
        self._model = self.loaded.model
        self._tokenizer = self.loaded.tokenizer
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        folder = Path(self._model.name_or_path)
        self.pooling = read_pooling(folder)
        self.max_length = self._max_length(folder)

    def _max_length(self, folder: Path) -> int:
        """sentence-transformers' `max_seq_length`, else the tokenizer's or the model's, capped by the spec."""
        st_config = _read_json(folder / "sentence_bert_config.json") or {}
        limits = [
            st_config.get("max_seq_length"),
            self._tokenizer.model_max_length if self._tokenizer.model_max_length < 1_000_000 else None,
            getattr(self._model.config, "max_position_embeddings", None),
        ]
        found = next((int(n) for n in limits if n), 512)
        return min(found, self.spec.engine.max_seq_len or found)

    def info(self) -> EngineInfo:
        return describe(self.kind, self.loaded, {
                "dimensions": self._model.config.hidden_size,
                "pooling": self.pooling.mode,
                "normalize": self.pooling.normalize,
                "max_length": self.max_length,
                "torch_threads": self.compute.cores.threads,
            })

    async def embed(self, texts: list[str]) -> EmbeddingResult:
        vectors: list[list[float]] = []
        tokens = 0
        for start in range(0, len(texts), BATCH_SIZE):
            batch_vectors, batch_tokens = await self.compute.run(self._embed_batch, texts[start : start + BATCH_SIZE])
            vectors.extend(batch_vectors)
            tokens += batch_tokens
        return EmbeddingResult(vectors=vectors, prompt_tokens=tokens)

    async def between_steps(self, fn: Callable[[], T]) -> T:
        return await self.compute.run(fn)

    def close(self) -> None:
        self.compute.shutdown()

    def _embed_batch(self, texts: list[str]) -> tuple[list[list[float]], int]:
        batch = self._tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.loaded.device)
        with torch.inference_mode():
            hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"]
        return pool(hidden, mask, self.pooling).cpu().tolist(), int(mask.sum())
