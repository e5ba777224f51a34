"""ISQ with torchao: pick a torchao config for an ISQ level on a device, then quantize a loaded model in place.

torchao has no GGUF block formats, so every level becomes the nearest weight-only format that is *not worse*:

| level                    | CPU                               | CUDA                               | exact |
|--------------------------|-----------------------------------|------------------------------------|-------|
| Q4_0 Q4_1 Q4K HQQ4 4     | int4 groups of 32                 | int4 (tinygemm) groups of 32       | yes   |
| Q2K Q3K 2 3              | int4 groups of 32                 | int4 (tinygemm) groups of 32       | no    |
| Q8_0 Q8_1 Q8K            | int8 symmetric, groups of 32      | int8 symmetric, groups of 32       | yes   |
| HQQ8 8                   | int8 per output channel           | int8 per output channel            | yes   |
| Q5_0 Q5_1 Q5K Q6K 5 6    | int8 per output channel           | int8 per output channel            | no    |
| FP8                      | int8 per output channel           | float8 e4m3 per channel            | CUDA  |

On CPU every level also stores a tied embedding / lm_head pair once, as int8 in blocks of 32 (`tied_embedding`).

Why these choices, measured on SmolLM2 with `bench/bench_quantization.py`:
- Groups of 32 for 4-bit because the GGUF 4-bit types quantize in blocks of 32 (Q4K's super-blocks hold 32-wide
  sub-blocks with their own scale and min): groups of 64 cost +38% perplexity against +0.5% for 32. That checkpoint
  is itself dequantized Q4_1, which flatters 32; moved off that grid (`--degrid`) it is +51% against +7%. torchao's
  HQQ choice of scales looks better on the Q4_1 grid (+0.1%) but is far worse off it (+36%), so min/max it is.
- The GGUF 8-bit names keep their blocks of 32: per-channel int8 costs +1.2% perplexity on SmolLM2 against +0.6%
  for blocks. The price is CPU decode speed (torchao dequantizes grouped int8 on every call: about 10 tok/s against
  about 24 for per-channel on SmolLM2), so the bare `8` stays per-channel for whoever prefers speed.

Only `nn.Linear` layers are quantized by torchao; a Linear is left alone when its weight is tied to another module
and could not be handled as a pair, when its `in_features` does not divide into the group size, or when its weight
is already quantized.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torchao.core.config import AOBaseConfig
from torchao.prototype.quantization.int4.inference_workflow import PrototypeInt4WeightOnlyConfig
from torchao.quantization import (
    Float8WeightOnlyConfig,
    Int4WeightOnlyConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.granularity import PerGroup
from torchao.quantization.quantize_.workflows import Int4PackingFormat

from rayrunner.errors import InvalidSpecError, ModelLoadError
from rayrunner.quantization.names import IsqLevel, parse_isq
from rayrunner.quantization.tied_embedding import quantize_tied_embedding
from rayrunner.quantization.weights import weight_bytes

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # the GGUF block size
GGUF_INT8_NAMES = frozenset({"Q8_0", "Q8_1", "Q8K"})
TIED_EMBEDDING_NOTE = "; tied embedding/lm_head int8 g32"
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class QuantPlan:
    """The torchao config for one level on one device, how to describe it, and the group size it needs."""

    config: AOBaseConfig
    applied: str
    exact: bool
    group_size: int | None = None


def plan_for(level: IsqLevel, device_type: str) -> QuantPlan:
    """The torchao plan for `level` on `device_type` ("cpu" or "cuda"); see the module table."""
    # set_inductor_config=False everywhere: rayrunner does not torch.compile, so leave global inductor flags alone.
    if level.is_float and device_type == "cuda":
        return QuantPlan(Float8WeightOnlyConfig(set_inductor_config=False), "torchao float8 e4m3 weight-only (CUDA)",
                         exact=True)
    exact = not level.is_float and level.bits in (4, 8)
    if level.bits <= 4:
        return _int4_plan(device_type, exact)
    if level.name in GGUF_INT8_NAMES:
        return QuantPlan(IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(GROUP_SIZE)),
                         f"torchao int8 weight-only g{GROUP_SIZE} ({device_type.upper()})", exact, GROUP_SIZE)
    return QuantPlan(Int8WeightOnlyConfig(set_inductor_config=False),
                     f"torchao int8 weight-only per-channel ({device_type.upper()})", exact)


def _int4_plan(device_type: str, exact: bool) -> QuantPlan:
    config: AOBaseConfig
    if device_type == "cuda":
        # The tinygemm layout runs on plain CUDA torch; the default "plain" layout needs the mslk kernels.
        config = Int4WeightOnlyConfig(group_size=GROUP_SIZE, set_inductor_config=False,
                                      int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
    else:
        # Plain Int4WeightOnlyConfig has no CPU kernel; the prototype one packs for the CPU tinygemm kernel.
        config = PrototypeInt4WeightOnlyConfig(group_size=GROUP_SIZE, set_inductor_config=False)
    return QuantPlan(config, f"torchao int4 weight-only g{GROUP_SIZE} ({device_type.upper()})", exact,
                     GROUP_SIZE)


def quantize_model(model: torch.nn.Module, isq: str, device: str) -> dict[str, Any]:
    """Quantize `model` in place (a tied embedding first, then each Linear in turn) and report what was done."""
    level = parse_isq(isq)
    plan = plan_for(level, _device_type(device))
    try:
        tied = quantize_tied_embedding(model)
        chosen, skipped = select_layers(model, plan.group_size)
        if skipped:
            logger.info("ISQ %s: leaving %d Linear layers unquantized: %s", level.name, len(skipped),
                        ", ".join(skipped))
        quantize_(model, plan.config, filter_fn=lambda _module, fqn: fqn in chosen)
    except Exception as exc:
        raise ModelLoadError(f"in-situ quantization to {level.name} failed: {type(exc).__name__}: {exc}") from exc
    return {
        "requested": level.name,
        "applied": plan.applied + (TIED_EMBEDDING_NOTE if tied else ""),
        "exact": plan.exact,
        "quantized_layers": len(chosen),
        "skipped_layers": len(skipped),
        "tied_embedding_int8": tied,
        "weight_bytes": weight_bytes(model),
    }


def _device_type(device: str) -> str:
    kind = device.split(":", 1)[0]
    if kind not in DEVICES:
        raise InvalidSpecError(f"in-situ quantization runs on {' or '.join(DEVICES)}, not on `{device}`",
                               param="in_situ_quant")
    return kind


def select_layers(model: torch.nn.Module, group_size: int | None) -> tuple[set[str], list[str]]:
    """Names of the Linear layers to quantize, and of those that must be left alone."""
    tied = _tied_storages(model)
    chosen: set[str] = set()
    skipped: list[str] = []
    for fqn, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            if _quantizable(module, group_size, tied):
                chosen.add(fqn)
            else:
                skipped.append(fqn)
    return chosen, skipped


def _quantizable(linear: torch.nn.Linear, group_size: int | None, tied: set[int]) -> bool:
    weight = linear.weight
    if type(weight.data) is not torch.Tensor or not weight.is_floating_point():
        return False  # already a quantized tensor subclass, or integer weights
    if weight.untyped_storage().data_ptr() in tied:
        return False
    return group_size is None or linear.in_features % group_size == 0


def _tied_storages(model: torch.nn.Module) -> set[int]:
    """Storages that more than one module holds as a parameter (e.g. an lm_head tied to the embedding)."""
    owners = Counter(
        param.untyped_storage().data_ptr()
        for module in model.modules()
        for param in module.parameters(recurse=False)
        if type(param.data) is torch.Tensor
    )
    return {ptr for ptr, count in owners.items() if count > 1}
