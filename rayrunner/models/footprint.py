"""A model's memory before it is loaded, for `max_loaded_bytes`: its weights at the dtype it will load in (read
from the safetensors headers or the GGUF file's size), shrunk by in-situ quantization, plus a KV cache reserve of
one full-length sequence (from config.json), or the engine's KV budget when set (`engine.kv_cache_bytes`; the vllm
backend's `vllm.kv_cache_bytes`). Rough by design; once a
model has loaded, its measured weight bytes replace the weight part.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from rayrunner.models.spec import ModelSpec
from rayrunner.models.which import GGUF

_LOADED_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
_KV_TOKENS_CAP = 4096  # a reserve for one sequence, not the model's whole context window


def estimate_bytes(spec: ModelSpec, measured_weight_bytes: int | None = None) -> int:
    """Weights plus KV reserve, times the most replicas the model may run (each holds both); 0 when the weights
    cannot be found or read locally (nothing is downloaded here). `measured_weight_bytes`: one replica's."""
    return _replica_bytes(spec, measured_weight_bytes) * spec.engine.max_replicas


def _replica_bytes(spec: ModelSpec, measured_weight_bytes: int | None) -> int:
    folder, gguf_file = _local_source(spec)
    if folder is None:
        return measured_weight_bytes or 0
    try:
        weights = measured_weight_bytes or _weight_bytes(spec, folder, gguf_file)
        return weights + _kv_reserve(spec, folder)
    except (OSError, ValueError, struct.error):  # unreadable files: the load itself will say what is wrong
        return measured_weight_bytes or 0


def _local_source(spec: ModelSpec) -> tuple[Path | None, str | None]:
    """The weights folder (and GGUF file) when they are on this machine: a folder, a file, a builtin, or a hub
    id already in the cache."""
    from rayrunner.models.sources import BUILTIN, resolve

    which = spec.which
    gguf_file = which.quantized_filename if isinstance(which, GGUF) else None
    location = which.quantized_model_id if isinstance(which, GGUF) else which.model_id
    try:
        if location in BUILTIN or Path(location).expanduser().exists():
            source = resolve(location, gguf_file)
            return Path(source.path), source.gguf_file
        return _cached_hub_folder(location, which.revision, which.hf_cache_path), gguf_file
    except Exception:
        return None, None


def _cached_hub_folder(repo_id: str, revision: str | None, cache: str | None) -> Path | None:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))


def expected_weight_bytes(spec: ModelSpec) -> int:
    """The weights' bytes once loaded, from their files (0 when they are not on this machine)."""
    folder, gguf_file = _local_source(spec)
    try:
        return _weight_bytes(spec, folder, gguf_file) if folder is not None else 0
    except (OSError, ValueError, struct.error):
        return 0


def _weight_bytes(spec: ModelSpec, folder: Path, gguf_file: str | None) -> int:
    if gguf_file is not None:
        count = (folder / gguf_file).stat().st_size * 2  # about 4 bits a weight, dequantized on load
    else:
        count = sum(_safetensors_numel(path) for path in folder.glob("*.safetensors"))
    return int(count * _bytes_per_weight(spec, folder))


def _bytes_per_weight(spec: ModelSpec, folder: Path) -> float:
    """The loaded dtype's size; with ISQ, int8 (1 byte) for 5-8 bit names and int4 (half a byte) for 2-4 bit."""
    if spec.in_situ_quant is None:
        return _loaded_bytes(spec, folder)
    from rayrunner.quantization import parse_isq

    return 0.5 if parse_isq(spec.in_situ_quant).bits <= 4 else 1.0


def _safetensors_numel(path: Path) -> int:
    """Element count of every tensor in the file, read from its JSON header only."""
    with path.open("rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8))
        header: dict[str, Any] = json.loads(handle.read(size))
    return sum(math.prod(int(dim) for dim in tensor.get("shape", []))
               for name, tensor in header.items() if name != "__metadata__")


def _kv_reserve(spec: ModelSpec, folder: Path) -> int:
    if spec.engine.kv_cache_bytes is not None:
        return spec.engine.kv_cache_bytes  # the most the engine's caches hold (vLLM reserves it at start)
    if spec.engine.backend == "vllm":
        return spec.engine.vllm.kv_cache_bytes  # what vLLM reserves at start, used or not
    config_path = folder / "config.json"
    if not config_path.exists():
        return 0
    config = json.loads(config_path.read_text())
    config = config.get("text_config", config)
    layers = int(config.get("num_hidden_layers", 0))
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config.get("hidden_size", 0)) // max(heads, 1))
    tokens = spec.engine.max_seq_len or min(int(config.get("max_position_embeddings", 2048)), _KV_TOKENS_CAP)
    return 2 * layers * kv_heads * head_dim * tokens * _loaded_bytes(spec, folder)


def _loaded_bytes(spec: ModelSpec, folder: Path) -> int:
    """Bytes a value takes at the dtype the model loads in: `auto` loads a model whose config says float32 in
    float32, any other in a 2-byte dtype (see loading.pick_dtype)."""
    if spec.which.dtype != "auto":
        return _LOADED_BYTES[spec.which.dtype]
    path = folder / "config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    for part in (config, config.get("text_config") or {}):
        declared = part.get("dtype") or part.get("torch_dtype")
        if declared:
            return 4 if declared == "float32" else 2
    return 2
