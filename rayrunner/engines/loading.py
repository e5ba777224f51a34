"""Load a model's weights and tokenizer/processor with transformers, on the right device and dtype.

Shared by every engine: resolves the source, checks the declared architecture, picks device and dtype, and applies
in-situ quantization after the weights are in place (one module at a time, so no second full copy is held).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rayrunner.errors import InvalidSpecError, ModelLoadError, RayRunnerError
from rayrunner.models.architectures import check_arch, mrope_refusal
from rayrunner.models.load_progress import LoadProgress, for_model
from rayrunner.models.sources import ResolvedSource, resolve
from rayrunner.models.spec import ModelSpec
from rayrunner.models.which import GGUF
from rayrunner.quantization.cpu_gemm import widen_linears
from rayrunner.quantization.model_cache import QuantizedModelCache
from rayrunner.quantization.packed_linear import pack_linears

_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


@dataclass
class Loaded:
    """A loaded model and what was applied while loading it."""

    model: Any
    tokenizer: Any
    processor: Any
    device: str
    dtype: str
    quantization: dict[str, Any] | None
    load_time_s: float


def pick_device(requested: str) -> str:
    """`auto`: CUDA only when this process was given a GPU. Ray no longer hides a node's GPUs from an actor that
    reserved none, so a CPU replica on a GPU node would otherwise take a GPU another replica reserved."""
    if requested == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device `cuda` was requested but this replica has no GPU (set engine.num_gpus)")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() and _assigned_gpus() else "cpu"
    return requested


def _assigned_gpus() -> bool:
    """Whether Ray assigned this worker GPUs (True outside Ray: a plain process may use what it sees)."""
    import ray

    return not ray.is_initialized() or bool(ray.get_gpu_ids())


def pick_dtype(requested: str, config: Any = None, device: str = "cpu") -> torch.dtype:
    """The dtype to load in: the one asked for, or for `auto` the config's (`dtype`, which transformers also reads
    from an older config's `torch_dtype`) where `device` runs it well, else bf16 (see `_auto_dtype`)."""
    if requested in _DTYPES:
        return _DTYPES[requested]
    return _auto_dtype(_config_dtype(config), device)


def _config_dtype(config: Any) -> torch.dtype | None:
    """The dtype a model's config names (a multimodal one's may name it only in its text config)."""
    for part in (config, getattr(config, "text_config", None)):
        value = getattr(part, "dtype", None)
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if isinstance(value, torch.dtype):
            return value
    return None


def _auto_dtype(declared: torch.dtype | None, device: str) -> torch.dtype:
    """float32 and bf16 as declared. float16 stays on a GPU, but is bf16 on CPU: the same bytes, with float32's
    range (no float16 weight overflows), and the CPU paths are bf16 ones (oneDNN's AMX/AVX-512 bf16 GEMMs,
    rayrunner's decode kernel) where float16 mostly falls back to generic kernels. bf16 is float16 on a GPU
    without bf16. Nothing declared (a GGUF's config), or another dtype: bf16, faster than float32 on recent CPUs and
    half the bytes."""
    if declared == torch.float32:
        return torch.float32
    on_gpu = device.startswith("cuda")
    if declared == torch.float16 and on_gpu:
        return torch.float16
    if on_gpu and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def resolve_which(spec: ModelSpec, progress: LoadProgress | None = None) -> tuple[ResolvedSource, str | None]:
    """The weights folder, plus the tokenizer location when it differs from the weights. A model added at runtime
    has its locations checked again here, on the node that reads them (`engine.sources`)."""
    which, policy = spec.which, spec.engine.sources
    if policy is not None:
        policy.check(which)
    if isinstance(which, GGUF):
        source = resolve(which.quantized_model_id, which.quantized_filename, which.revision, which.hf_cache_path,
                         progress, policy)
        if source.gguf_file is None:
            raise InvalidSpecError("Which.GGUF needs `quantized_filename` or a path to a .gguf file")
        tok = resolve(which.tok_model_id, progress=progress, policy=policy).path if which.tok_model_id else None
        return source, tok
    source = resolve(which.model_id, None, which.revision, which.hf_cache_path, progress, policy)
    tok = getattr(which, "tokenizer_json", None)
    return source, tok


def load_config(source: ResolvedSource) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    except Exception as exc:
        raise ModelLoadError(f"cannot read the model config at `{source.path}`: {exc}") from None


def load_model(spec: ModelSpec, auto_class: Any, with_processor: bool = False) -> Loaded:
    """Load `spec` with `auto_class` (e.g. AutoModelForCausalLM); raise ModelLoadError with the cause. Each phase
    is reported as the model's load progress; the engine that called this reports `ready` once it has started."""
    from transformers import AutoProcessor, AutoTokenizer

    start = time.perf_counter()
    progress = for_model(spec.app_name, spec.model_id)
    progress.phase("resolving")
    source, tok_location = resolve_which(spec, progress)
    config = load_config(source)
    check_arch(getattr(spec.which, "arch", None), config.model_type, spec.which.kind == "multimodal")
    device = pick_device(spec.engine.device)
    dtype = pick_dtype(spec.which.dtype, config, device)
    model, quantization = _model(spec, auto_class, source, config, device, dtype, progress)
    if with_processor:
        check_positions(model)
    if device == "cpu":
        widen_linears(model)  # prefill matmuls in float32 where this CPU has no native bf16/fp16 GEMM
        pack_linears(model)  # bf16 weights prepacked for oneDNN where this CPU has a native bf16 GEMM
    with _as_load_error(spec):
        tok_path = tok_location or source.path
        tok_kwargs: dict[str, Any] = {} if tok_location else {"gguf_file": source.gguf_file}
        tokenizer = AutoTokenizer.from_pretrained(tok_path, **tok_kwargs)
        processor = AutoProcessor.from_pretrained(source.path) if with_processor else None
    progress.phase("warming up")
    return Loaded(model, tokenizer, processor, device, str(dtype).removeprefix("torch."), quantization,
                  time.perf_counter() - start)


def check_positions(model: Any) -> None:
    """Refuse a vision-language model that computes its own positions (a `get_rope_index`, M-RoPE) though its
    type is not among `MROPE_MODEL_TYPES`: the step scheduler would override them."""
    if any(hasattr(part, "get_rope_index") for part in (model, getattr(model, "model", None))):
        raise mrope_refusal(f"model_type `{model.config.model_type}`", "which")


def _model(spec: ModelSpec, auto_class: Any, source: ResolvedSource, config: Any, device: str, dtype: torch.dtype,
           progress: LoadProgress) -> tuple[Any, dict[str, Any] | None]:
    """The model and its quantization report: from the quantized model cache when it holds this load, else read
    from the source and quantized in situ as the spec asks (then cached)."""
    isq = spec.in_situ_quant if spec.engine.cache_quantized else None
    cache = _quantized_cache(spec.model_id, source, device, dtype, auto_class, isq)
    hit = cache is not None and cache.path.is_file()
    progress.phase("reading", device=device, **({"quantized_cache": spec.in_situ_quant} if hit else {}))
    cached = cache.load(auto_class, config, dtype) if cache is not None and hit else None
    if cached is not None:
        return cached
    with _as_load_error(spec):
        # Memory-mapped (transformers' default; private, so a change to a weight copies only its pages): the
        # weights are the cache file's pages, freed with the process. In a fresh replica process, reading them
        # into new memory instead (`disable_mmap=True`) took SmolLM2 bf16 0.5-0.6 s against 0.2-0.26 s mapped.
        model = auto_class.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=dtype,
                                           device_map=_device_map(spec, device))
    model.eval()
    if source.gguf_file is not None:
        model.hf_quantizer = None  # GGUF is dequantized on load; the in-memory weights are plain tensors
    if spec.in_situ_quant is None:
        return model, None
    from rayrunner.quantization import quantize_model

    progress.phase("quantizing", in_situ_quant=spec.in_situ_quant)
    quantization = quantize_model(model, spec.in_situ_quant, device)
    if cache is not None:
        cache.save(model, quantization)
    return model, quantization


def _device_map(spec: ModelSpec, device: str) -> str:
    """`auto` (accelerate's layers spread over the replica's GPUs) for a replica that reserved several, else the
    one device."""
    return "auto" if device == "cuda" and spec.engine.num_gpus > 1 and torch.cuda.device_count() > 1 else device


@contextlib.contextmanager
def _as_load_error(spec: ModelSpec) -> Iterator[None]:
    """Raise what fails inside as a ModelLoadError naming the model (rayrunner's own errors pass as they are)."""
    try:
        yield
    except RayRunnerError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"{spec.model_id}: {type(exc).__name__}: {exc}") from None


def _quantized_cache(model_id: str, source: ResolvedSource, device: str, dtype: torch.dtype, auto_class: Any,
                     isq: str | None) -> QuantizedModelCache | None:
    """Where a quantized load is kept whole (`quantization.model_cache`); None for a model in its own dtype."""
    if isq is None:
        return None
    settings = {"isq": isq, "dtype": str(dtype), "device": device, "class": auto_class.__name__,
                "gguf_file": source.gguf_file}
    return QuantizedModelCache.for_load(model_id, source.path, settings)
