"""A model's memory before it is loaded, for `max_loaded_bytes`: its weights at the dtype it will load in (read
from the safetensors headers or the GGUF file's size), shrunk by in-situ quantization, plus its KV budget: the
engine's (`engine.kv_cache_bytes`; the vllm backend's `vllm.kv_cache_bytes`), else the default one replica takes
(`CPU_KV_BYTES` on CPU; on a GPU, `gpu_kv_budget` of its share of the device, known once a replica has loaded and
reported it). Rough by design; once a model has loaded, its measured weight bytes and KV budget replace the estimate.
A size that cannot be told (weights not on this machine, a GPU budget before any replica reported one) is None, and
the capacity plan counts it as `rayrunner.registry.eviction_rules` says.

The default KV budget's rule lives here, torch-free, so the replica (`engines.transformers.kv.kv_memory`) and the
capacity estimate use the same one.
"""

from __future__ import annotations

import json
import logging
import math
import struct
from pathlib import Path
from typing import Any

from rayrunner.errors import ModelLoadError
from rayrunner.models.spec import ModelSpec
from rayrunner.models.which import GGUF

logger = logging.getLogger(__name__)

_LOADED_BYTES = {"f32": 4, "f16": 2, "bf16": 2}
CPU_KV_BYTES = 1 << 30  # the default KV budget of a replica on CPU
GPU_KV_FRACTION = 0.5  # of what a replica's share of its GPU leaves beside its weights: the rest is for activations


def gpu_kv_budget(total: int, free: int, held: int, share: float) -> int:
    """The default KV budget of a replica on a GPU of `total` bytes that holds `held` bytes of its own tensors (its
    weights) and reserved `share` of the GPU (`engine.num_gpus`; a whole GPU or more counts one device):
    `GPU_KV_FRACTION` of what its share leaves beside its tensors. Ray places replicas so that the shares on one GPU
    add up to one at most, so the replicas sharing a GPU stay within it together, whenever each starts. `share` 0
    (no GPU reserved: `device: cuda` without `num_gpus`, or outside Ray): nothing says who else uses the device, so
    `GPU_KV_FRACTION` of the memory `free` now. Raises ModelLoadError when the weights fill the share."""
    if share <= 0:
        return int(free * GPU_KV_FRACTION)
    room = int(total * min(share, 1.0)) - held
    if room <= 0:
        raise ModelLoadError(f"the weights take {held:,} bytes, all of this replica's share of the GPU "
                             f"({min(share, 1.0):g} of {total:,} bytes): no room for its KV cache; raise "
                             "engine.num_gpus", param="num_gpus")
    return int(room * GPU_KV_FRACTION)


def replica_measures(info: dict[str, Any]) -> tuple[int | None, int | None]:
    """A loaded replica's weight bytes and KV budget, from its info (`ModelServer.info`; None: not reported)."""
    scheduler = (info.get("extra") or {}).get("scheduler") or {}
    return info.get("weight_bytes") or None, scheduler.get("kv_cache_budget_bytes") or None


def estimate_bytes(spec: ModelSpec, measured_weight_bytes: int | None = None,
                   measured_kv_bytes: int | None = None) -> int | None:
    """Weights plus KV budget, times the most replicas the model may run (each holds both); None (logged) when
    either cannot be told here (nothing is downloaded). `measured_*`: one loaded replica's (`replica_measures`)."""
    weights = measured_weight_bytes or _estimated_weights(spec)
    kv = _kv_budget(spec, measured_kv_bytes)
    if kv is None:
        logger.info("`%s`: size unknown until a replica reports it: its default KV budget depends on its GPU "
                    "(set engine.kv_cache_bytes to count it before)", spec.model_id)
    if weights is None or kv is None:
        return None
    return (weights + kv) * spec.engine.max_replicas


def _estimated_weights(spec: ModelSpec) -> int | None:
    """The weights' bytes once loaded, from their files; None (logged, with why) when they are not on this machine
    (a hub id not in its cache here) or cannot be read: the load itself will say what is wrong."""
    try:
        folder, gguf_file = _local_source(spec)
        return _weight_bytes(spec, folder, gguf_file)
    except Exception as exc:  # whatever the reason, the size is unknown, not 0
        logger.info("`%s`: size unknown until a replica reports it: its weights cannot be read here (%s: %s)",
                    spec.model_id, type(exc).__name__, exc)
        return None


def _kv_budget(spec: ModelSpec, measured: int | None) -> int | None:
    """The most one replica's KV caches hold: the engine's budget when set, else what a replica reported, else the
    default on CPU (None on a GPU: it depends on the device's memory, unknown here)."""
    if spec.which.kind == "embedding":
        return 0
    if spec.engine.kv_cache_bytes is not None:
        return spec.engine.kv_cache_bytes
    if spec.engine.backend == "vllm":
        return spec.engine.vllm.kv_cache_bytes  # what vLLM reserves at start, used or not
    if measured is not None:
        return measured
    return None if _on_gpu(spec) else CPU_KV_BYTES


def _on_gpu(spec: ModelSpec) -> bool:
    """Whether the model's replicas run on a GPU (`device: cuda`, or `auto` with `num_gpus`)."""
    engine = spec.engine
    return engine.device == "cuda" or (engine.device == "auto" and engine.num_gpus > 0)


def _local_source(spec: ModelSpec) -> tuple[Path, str | None]:
    """The weights folder (and GGUF file) on this machine: a folder, a file, a builtin, or a hub id already in the
    cache (raises when it is not)."""
    from rayrunner.models.sources import BUILTIN, resolve

    which = spec.which
    gguf_file = which.quantized_filename if isinstance(which, GGUF) else None
    location = which.quantized_model_id if isinstance(which, GGUF) else which.model_id
    if location in BUILTIN or Path(location).expanduser().exists():
        source = resolve(location, gguf_file)
        return Path(source.path), source.gguf_file
    return _cached_hub_folder(location, which.revision, which.hf_cache_path), gguf_file


def _cached_hub_folder(repo_id: str, revision: str | None, cache: str | None) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))


def expected_weight_bytes(spec: ModelSpec) -> int:
    """The weights' bytes once loaded, from their files (0 when they are not on this machine)."""
    return _estimated_weights(spec) or 0


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
