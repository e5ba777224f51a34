"""Matmuls of bf16/fp16 models in float32 on CPUs where PyTorch has no fast half-precision GEMM.

PyTorch multiplies bf16 (and fp16) matrices on CPU with oneDNN only where the CPU has the instructions for it
(AVX-512 BW/VL/DQ for bf16: `torch.ops.mkldnn._is_mkldnn_bf16_supported()`); elsewhere, e.g. on AVX2-only x86 CPUs
such as many AMD EPYC hosts, it falls back to a generic kernel. Measured on a 2-core AVX2 EPYC, SmolLM2's shapes
(`bench/bench_prefill.py` has the model-level figures):
- 64 rows x 576 -> 3072: bf16 15.9 ms, fp16 14.1 ms, float32 4.0 ms;
- converting an int8 weight for 128 rows: to bf16 then a bf16 GEMM 35.7 ms, to float32 then float32's 9.5 ms.
So on such CPUs the many-row matmuls of a prompt's prefill run in float32: the activations and the weight are
widened (exactly: every bf16/fp16 value is a float32), multiplied, and the result rounded back once. Decode steps
(one position per row) keep the half-precision kernels, which read half the bytes and are faster for a few rows
(one row x 576 -> 3072: bf16 0.46 ms; widening the weight first costs more than it saves).

Which matmuls widen is decided by the input's shape, never by how many sequences share a batch, so a sequence's
prefill computes the same numbers alone and batched with others.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bf16 or fp16) matrices with a native kernel (oneDNN)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a build without oneDNN: no native kernel either
        return False


@functools.cache
def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon since Sapphire Rapids), which PyTorch's CPU kernels use for bf16
    blocks (its flash attention's brgemm among them)."""
    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to multiply `dtype` matrices in on this CPU: float32 for a half dtype without a native GEMM."""
    return torch.float32 if dtype in HALF_DTYPES and not native_half_gemm(dtype) else dtype


class WideLinear(nn.Linear):
    """An `nn.Linear` (same parameters and state dict) that runs a prefill's inputs, [rows, positions > 1, in],
    in float32 (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 3 or x.shape[-2] == 1:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def widen_linears(model: nn.Module) -> int:
    """Make every plain half-precision `nn.Linear` of a CPU model a `WideLinear` where this CPU has no native GEMM
    for its dtype; the number changed. Quantized Linears (a tensor subclass as weight) and other modules are left
    as they are."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear and _plain_half_cpu(module.weight):
            module.__class__ = WideLinear
            changed += 1
    return changed


def plain_cpu_weight(weight: Any) -> bool:
    """Whether `weight` is a plain tensor (no quantized subclass) in CPU memory."""
    return weight is not None and type(weight.data) is torch.Tensor and weight.device.type == "cpu"


def _plain_half_cpu(weight: Any) -> bool:
    return plain_cpu_weight(weight) and weight.dtype in HALF_DTYPES and not native_half_gemm(weight.dtype)
