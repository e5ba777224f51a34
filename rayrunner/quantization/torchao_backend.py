"""ISQ with torchao: pick a format for an ISQ level on a device, then quantize a loaded model in place.

torchao has no GGUF block formats, so every level becomes a weight-only format of at least its bits:

| level                 | CPU                     | CUDA                         | exact |
|-----------------------|-------------------------|------------------------------|-------|
| Q4_0 Q4_1 Q4K HQQ4 4  | int4 groups of 32       | int4 (tinygemm) groups of 32 | yes   |
| Q2K Q3K 2 3           | int4 groups of 32       | int4 (tinygemm) groups of 32 | no    |
| Q8_0 Q8_1 Q8K         | int8 rows (`int8_rows`) | int8 symmetric, groups of 32 | yes   |
| HQQ8 8                | int8 rows (`int8_rows`) | int8 per output channel      | yes   |
| Q5_0 Q5_1 Q5K Q6K 5 6 | int8 rows (`int8_rows`) | int8 per output channel      | no    |
| FP8                   | int8 rows (`int8_rows`) | float8 e4m3 per channel      | CUDA  |

On CPU every level also stores a tied embedding / lm_head pair once, as int8 with one scale per row
(`tied_embedding`). CPU int8 rows (one scale per output channel) are rayrunner's `Int8Linear`, put in place
of the Linear; every other format is a torchao tensor in the Linear's weight.

Why these choices, measured on SmolLM2 with `bench/bench_quantization.py`:
- Groups of 32 for 4-bit because the GGUF 4-bit types quantize in blocks of 32 (Q4K's super-blocks hold 32-wide
  sub-blocks with their own scale and min): groups of 64 cost +38% perplexity against +0.5% for 32. That checkpoint
  is itself dequantized Q4_1, which flatters 32; moved off that grid (`--degrid`) it is +51% against +7%. torchao's
  HQQ choice of scales looks better on the Q4_1 grid (+0.1%) but is far worse off it (+36%), so min/max it is.
- On CPU the GGUF 8-bit names take int8 rows too: torchao dequantizes int8 groups of 32 on every call (Q8_0 decoded
  at about half of bf16's speed), while a per-row scale lets one int8 kernel call read the weight (decode steps
  1.9x as fast as bf16's at batch 1, 0.9x at 16 sequences; details in `int8_rows`), for +0.85% perplexity against
  +0.47% for blocks of 32: within the Q8_0 target of +1%. CUDA keeps the blocks (its speed was not measured here).

Each level is a chain of formats tried in order per Linear: its own, then those of the int8 rows below it (on CUDA
blocks of 32, then per channel; on CPU int8 rows). A Linear takes the first format whose kernel can hold its shape
(checked up front: `QuantPlan.misfit`), and the report lists it under `fallback_layers` when that is not the
level's own. It stays in the model's dtype, listed under `skipped_layers` with the reason, when no format fits, when
its weight is tied to another module and could not be handled as a pair, when it is already quantized, or when it
is the whole model (a module cannot be replaced by itself).

What each kernel needs, from torch and torchao's source:
- int4 on CPU (`_convert_weight_to_int4pack_cpu`): out_features a multiple of 16, in_features of the group size.
- int4 on CUDA (tinygemm): in_features a multiple of the group size, bfloat16 weights, compute capability 8.0+;
  torchao pads out_features to 8 and in_features to 1024 itself.
- int8 in groups: in_features a multiple of the group size. Per-channel int8 and float8 on CUDA: any shape but a
  single input column (torchao mis-shapes its scale). CPU int8 rows: any shape.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
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
from rayrunner.quantization.int8_rows import Int8Linear
from rayrunner.quantization.names import IsqLevel, parse_isq
from rayrunner.quantization.tied_embedding import quantize_tied_embedding, tied_head_misfit
from rayrunner.quantization.weights import weight_bytes

logger = logging.getLogger(__name__)

GROUP_SIZE = 32  # the GGUF block size
CPU_INT4_ROWS = 16  # the CPU int4 kernel packs output rows 16 at a time
TINYGEMM_MIN_CAPABILITY = (8, 0)
GGUF_INT8_NAMES = frozenset({"Q8_0", "Q8_1", "Q8K"})
TIED_EMBEDDING_NOTE = "; tied embedding/lm_head int8 per-row"
TIED_REASON = "weight tied to another module: quantizing it alone would make a second copy"
DEVICES = ("cpu", "cuda")

Check = Callable[[torch.nn.Linear], str | None]


@dataclass(frozen=True)
class QuantPlan:
    """One weight-only format: a torchao config (the weight becomes a torchao tensor) or a function building the
    module that replaces the Linear; how the report names it; what a Linear needs to take it."""

    config: AOBaseConfig | Callable[[torch.nn.Linear], torch.nn.Module]
    applied: str
    checks: tuple[Check, ...] = ()

    def misfit(self, linear: torch.nn.Linear) -> str | None:
        """Why `linear` cannot take this format (the first need it misses), or None when it fits."""
        return next((why for check in self.checks if (why := check(linear)) is not None), None)

    def apply(self, model: torch.nn.Module, names: list[str]) -> None:
        """Quantize the Linears `names` of `model` to this format."""
        if isinstance(self.config, AOBaseConfig):
            quantize_(model, self.config, filter_fn=lambda _module, fqn: fqn in names)
            return
        for name in names:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            setattr(owner, child, self.config(getattr(owner, child)))


@dataclass
class Assignment:
    """The format each Linear takes, by name; those not in the level's own format, and those left alone, with why."""

    formats: dict[str, QuantPlan] = field(default_factory=dict)
    fallback: dict[str, dict[str, str]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def plans_for(level: IsqLevel, device_type: str, capability: tuple[int, int] | None = None) -> tuple[QuantPlan, ...]:
    """The formats for `level` on `device_type` ("cpu" or "cuda") in the order a Linear tries them (see the module
    docstring); `capability` is the CUDA device's compute capability (None: not checked)."""
    if device_type == "cpu":
        rows = QuantPlan(Int8Linear.from_linear, "rayrunner int8 weight-only per-channel (CPU)")
        return (_int4_plan(device_type, capability), rows) if level.bits <= 4 else (rows,)
    # set_inductor_config=False everywhere: rayrunner does not torch.compile, so leave global inductor flags alone.
    per_channel = QuantPlan(Int8WeightOnlyConfig(set_inductor_config=False),
                            "torchao int8 weight-only per-channel (CUDA)", (_two_columns,))
    if level.is_float:
        return (QuantPlan(Float8WeightOnlyConfig(set_inductor_config=False), "torchao float8 e4m3 weight-only (CUDA)",
                          (_two_columns,)),)
    grouped = QuantPlan(IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(GROUP_SIZE)),
                        f"torchao int8 weight-only g{GROUP_SIZE} (CUDA)", (_whole_groups,))
    if level.bits <= 4:
        return _int4_plan(device_type, capability), grouped, per_channel
    if level.name in GGUF_INT8_NAMES:
        return grouped, per_channel
    return (per_channel,)


def _int4_plan(device_type: str, capability: tuple[int, int] | None) -> QuantPlan:
    applied = f"torchao int4 weight-only g{GROUP_SIZE} ({device_type.upper()})"
    if device_type == "cuda":
        # The tinygemm layout runs on plain CUDA torch; the default "plain" layout needs the mslk kernels.
        config = Int4WeightOnlyConfig(group_size=GROUP_SIZE, set_inductor_config=False,
                                      int4_packing_format=Int4PackingFormat.TILE_PACKED_TO_4D)
        return QuantPlan(config, applied, (_whole_groups, _bf16, _sm80(capability)))
    # Plain Int4WeightOnlyConfig has no CPU kernel; the prototype one packs for the CPU tinygemm kernel.
    config = PrototypeInt4WeightOnlyConfig(group_size=GROUP_SIZE, set_inductor_config=False)
    return QuantPlan(config, applied, (_whole_groups, _cpu_int4_rows))


def _whole_groups(linear: torch.nn.Linear) -> str | None:
    if linear.in_features % GROUP_SIZE:
        return f"in_features {linear.in_features} is not a multiple of the group size {GROUP_SIZE}"
    return None


def _cpu_int4_rows(linear: torch.nn.Linear) -> str | None:
    if linear.out_features % CPU_INT4_ROWS:
        return (f"out_features {linear.out_features} is not a multiple of {CPU_INT4_ROWS} "
                f"(the CPU int4 kernel packs rows {CPU_INT4_ROWS} at a time)")
    return None


def _two_columns(linear: torch.nn.Linear) -> str | None:
    if linear.in_features < 2:
        return f"in_features {linear.in_features}: torchao cannot shape per-channel scales for a single input column"
    return None


def _bf16(linear: torch.nn.Linear) -> str | None:
    if linear.weight.dtype != torch.bfloat16:
        return f"tinygemm int4 takes bfloat16 weights, not {str(linear.weight.dtype).removeprefix('torch.')}"
    return None


def _sm80(capability: tuple[int, int] | None) -> Check:
    def check(_linear: torch.nn.Linear) -> str | None:
        if capability is not None and capability < TINYGEMM_MIN_CAPABILITY:
            return "tinygemm int4 needs compute capability 8.0+, this GPU has {}.{}".format(*capability)
        return None

    return check


def quantize_model(model: torch.nn.Module, isq: str, device: str) -> dict[str, Any]:
    """Quantize `model` in place (a tied embedding first, then each Linear in the first format that holds it) and
    report what was done."""
    level = parse_isq(isq)
    device_type = _device_type(device)
    capability = torch.cuda.get_device_capability(device) if device_type == "cuda" else None
    plans = plans_for(level, device_type, capability)
    try:
        kept_head = tied_head_misfit(model)
        tied = quantize_tied_embedding(model)
        layers = assign_layers(model, plans, kept_head)
        for plan in plans:
            plan.apply(model, [name for name, fit in layers.formats.items() if fit is plan])
    except Exception as exc:
        raise ModelLoadError(f"in-situ quantization to {level.name} failed: {type(exc).__name__}: {exc}") from exc
    for name, entry in layers.fallback.items():
        logger.info("ISQ %s: %s takes %s: %s", level.name, name, entry["applied"], entry["reason"])
    for name, reason in layers.skipped.items():
        logger.info("ISQ %s: %s stays unquantized: %s", level.name, name, reason)
    return {
        "requested": level.name,
        "applied": plans[0].applied + (TIED_EMBEDDING_NOTE if tied else ""),
        # exact: torchao has the level's own width (4 or 8 bits), and for FP8 a float8 format (CUDA only).
        "exact": level.bits in (4, 8) and (not level.is_float or device_type == "cuda"),
        "quantized_layers": len(layers.formats),
        "fallback_layers": layers.fallback,
        "skipped_layers": layers.skipped,
        "tied_embedding_int8": tied,
        "weight_bytes": weight_bytes(model),
    }


def _device_type(device: str) -> str:
    kind = device.split(":", 1)[0]
    if kind not in DEVICES:
        raise InvalidSpecError(f"in-situ quantization runs on {' or '.join(DEVICES)}, not on `{device}`",
                               param="in_situ_quant")
    return kind


def assign_layers(model: torch.nn.Module, plans: tuple[QuantPlan, ...],
                  kept_head: tuple[torch.nn.Linear, str] | None = None) -> Assignment:
    """The first of `plans` that holds each Linear, or why it stays as it is; `kept_head` is a tied lm_head that
    stays in the model's dtype, and why."""
    tied = _tied_storages(model)
    layers = Assignment()
    for fqn, module in model.named_modules():
        if isinstance(module, Int8Linear):
            layers.skipped[fqn] = "already quantized (Int8Linear)"
        if not isinstance(module, torch.nn.Linear):
            continue
        kept = _kept_reason(fqn, module, tied, kept_head)
        fit = None if kept is not None else next((plan for plan in plans if plan.misfit(module) is None), None)
        if fit is None:
            # A chain ends with its most permissive format, so that one's misfit says why none fits.
            layers.skipped[fqn] = kept if kept is not None else f"no format holds it: {plans[-1].misfit(module)}"
            continue
        layers.formats[fqn] = fit
        if fit is not plans[0]:
            layers.fallback[fqn] = {"applied": fit.applied, "reason": str(plans[0].misfit(module))}
    return layers


def _kept_reason(fqn: str, linear: torch.nn.Linear, tied: set[int],
                 kept_head: tuple[torch.nn.Linear, str] | None) -> str | None:
    """Why `linear` stays as it is whatever the format, or None when formats may be tried."""
    if not fqn:
        return "the model itself is this Linear: ISQ quantizes the Linears inside a model"
    weight = linear.weight
    if type(weight.data) is not torch.Tensor:
        return f"already quantized ({type(weight.data).__name__})"
    if not weight.is_floating_point():
        return f"{str(weight.dtype).removeprefix('torch.')} weights are not floating point"
    if kept_head is not None and linear is kept_head[0]:
        return f"tied to the input embedding, kept as one copy in the model's dtype: {kept_head[1]}"
    if weight.untyped_storage().data_ptr() in tied:
        return TIED_REASON
    return None


def _tied_storages(model: torch.nn.Module) -> set[int]:
    """Storages that more than one module holds as a parameter (e.g. an lm_head tied to the embedding)."""
    owners = Counter(
        param.untyped_storage().data_ptr()
        for module in model.modules()
        for param in module.parameters(recurse=False)
        if type(param.data) is torch.Tensor
    )
    return {ptr for ptr, count in owners.items() if count > 1}
