"""Fused bf16 operations for the fast decode step on CPU, compiled from `fused_ops.c` on first use.

Between its matmuls a decode step of a small model is many tiny PyTorch operations, each a few microseconds of
dispatch whatever its size: a residual add and an RMSNorm alone are nine of them, twice a layer; and a prompt's
prefill passes over its large activations once per operation. vLLM's CPU backend fuses these in C++ kernels of its
own; PyTorch has none (its `F.rms_norm` is the same operations composed, and inductor's compiled code costs more per
call than it saves at a few rows: docs/performance.md, "Fused operations"). Each function here is one call where the
step made several, computing what PyTorch's operations compute to the bit (every intermediate rounded to bf16 where
they round it, sums added in their order): `add_rms_norm`, `rope`, and `silu_mul` (SiLU of the gate times the up
projection, its exponential SLEEF's `expf_u10` operation for operation, as PyTorch's vectorized exp: equal to
PyTorch's on every bf16 input, tested exhaustively; SiLU itself a lookup in a table of every bf16 input, filled when
the library loads). `silu_sums` hands the tile kernel (`TileWeight.glu`) the same SiLU times up on a matmul's
float32 sums, so that the gate and up projections need not be written at all.

The C file is built for the node's CPU at first use (`native_build`). Without a compiler, or where the build fails,
`library()` is None and the step keeps PyTorch's operations. `RAYRUNNER_FUSED_OPS=0` turns the fused path off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from rayrunner.runtime import native_build

SOURCE = Path(__file__).with_suffix(".c")
SWITCH_ENV = "RAYRUNNER_FUSED_OPS"


@functools.cache
def library() -> ctypes.CDLL | None:
    """The fused operations, built if needed and loaded; None when switched off or not buildable here."""
    pointer, i64 = native_build.POINTER, native_build.I64
    return native_build.load(SOURCE, SWITCH_ENV, {
        "add_rms_norm": ([pointer, pointer, pointer, pointer, i64, i64, ctypes.c_float], ctypes.c_int),
        "rope": ([pointer, i64, pointer, pointer, pointer, i64, i64, i64], None),
        "silu_mul": ([pointer, i64, pointer, i64, i64, ctypes.c_int], None),
        "silu_mul_vectorized": ([], ctypes.c_int)})


def applies(hidden: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes `hidden`: bf16 on the CPU, with the library built."""
    return hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and library() is not None


def add_rms_norm(hidden: torch.Tensor, addend: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`hidden += addend` (in place; none when `addend` is None), then the RMS norm of `hidden` [rows, width] times
    `weight` [width], as transformers' `LlamaRMSNorm` computes it in bf16; a new tensor. Takes what `applies` says."""
    lib = _ready(hidden)
    if not hidden.is_contiguous() or hidden.dim() != 2:
        raise ValueError(f"hidden states {tuple(hidden.shape)} strided {hidden.stride()}: [rows, width], contiguous")
    rows, width = hidden.shape
    if addend is not None:
        addend = addend.contiguous()
        if addend.shape != hidden.shape or addend.dtype != hidden.dtype:
            raise ValueError(f"addend {tuple(addend.shape)} {addend.dtype} does not match {tuple(hidden.shape)}")
    weight = weight.contiguous()
    if weight.shape != (width,) or weight.dtype != hidden.dtype:
        raise ValueError(f"norm weight {tuple(weight.shape)} {weight.dtype} does not fit rows of {width}")
    out = torch.empty_like(hidden)
    if lib.add_rms_norm(hidden.data_ptr(), None if addend is None else addend.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), rows, width, eps) != 0:
        raise MemoryError(f"no memory for a scratch row of {width} floats")
    return out


def rope(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first `heads` heads of `x` [rows, more heads, dim] (rows may be strided), with `cos` and `sin`
    [rows, 1, dim] (`sin`'s first half negated): `x * cos + x.roll(dim // 2, -1) * sin` rounded as those bf16
    operations round; a new tensor [rows, heads, dim]."""
    lib = _ready(x)
    rows, total, dim = x.shape
    if heads > total or x.stride(1) != dim or x.stride(2) != 1:
        raise ValueError(f"rotating {heads} heads of a tensor {tuple(x.shape)} strided {x.stride()}")
    cos, sin = cos.contiguous(), sin.contiguous()
    for table in (cos, sin):
        if table.shape != (rows, 1, dim) or table.dtype != x.dtype:
            raise ValueError(f"RoPE table {tuple(table.shape)} {table.dtype} does not fit {(rows, 1, dim)}")
    out = torch.empty((rows, heads, dim), dtype=x.dtype)
    lib.rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, heads, dim)
    return out


def fuses_silu(hidden: torch.Tensor) -> bool:
    """Whether the step takes `silu_mul` for `hidden`'s kind: `applies`, and the library built with its AVX-512
    path (its scalar loop, elsewhere, is slower than PyTorch's vectorized SiLU)."""
    lib = library() if applies(hidden) else None
    return lib is not None and bool(lib.silu_mul_vectorized())


def silu_sums() -> int | None:
    """The address of `silu_mul_sums`, the C function `TileWeight.glu` combines a gate's and an up projection's
    float32 sums with (SiLU times up, rounded as `silu_mul` of the matmul's bf16 output); None where `silu_mul` is
    not fused here (`fuses_silu`)."""
    lib = library()
    if lib is None or not lib.silu_mul_vectorized():
        return None
    return ctypes.cast(lib.silu_mul_sums, ctypes.c_void_p).value


def silu_mul(gate_up: torch.Tensor, width: int) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up` [rows, 2 * width] (the gate's `width` values, then the up projection's; rows may
    be strided), rounded as `F.silu(gate).mul_(up)` rounds in bf16; a new tensor [rows, width]."""
    lib = _ready(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * width or gate_up.stride(1) != 1:
        raise ValueError(f"gate and up {tuple(gate_up.shape)} strided {gate_up.stride()}: [rows, 2 * {width}]")
    out = torch.empty((gate_up.shape[0], width), dtype=gate_up.dtype)
    lib.silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), gate_up.shape[0], width,
                 torch.get_num_threads())
    return out


def _ready(x: torch.Tensor) -> ctypes.CDLL:
    """The library, for a tensor `applies` takes."""
    lib = library()
    if lib is None or not applies(x):
        raise ValueError(f"the fused operations take bf16 CPU tensors where built, not {x.dtype} on {x.device}")
    return lib
