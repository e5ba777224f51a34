"""Fused bf16 operations for the fast decode step on CPU, compiled from `fused_ops.c` on first use.

Between its matmuls a decode step of a small model is many tiny PyTorch operations, each a few microseconds of
dispatch whatever its size: a residual add and an RMSNorm alone are nine of them, twice a layer; and a prompt's
prefill passes over its large activations once per operation. vLLM's CPU backend fuses these in C++ kernels of its
own; PyTorch has none (its `F.rms_norm` is the same operations composed, and inductor's compiled code costs more per
call than it saves at a few rows: docs/performance.md, "Fused operations"). Each function here is one call where the
step made several, computing what PyTorch's operations compute to the bit (every intermediate rounded to bf16 where
they round it, sums added in their order): `add_rms_norm`, `rope`, and `silu_mul` (SiLU of the gate times the up
projection, its exponential SLEEF's `expf_u10` operation for operation, as PyTorch's vectorized exp: equal to
PyTorch's on every bf16 input, tested exhaustively).

`decode_attention`, on CPUs with AVX-512 BF16, is a decode step's attention (one new position a row) in one call: the
scores by the CPU's bf16 dot-product instruction, 16 positions summed at once, the softmax in float32, the values
weighed in float32 registers and rounded to bf16 once, each head's values fetched into cache while its keys are
scored. PyTorch's flash SDPA runs the same at a few rows as blocked matmuls sized for prompts, at about half the
memory's speed (docs/performance.md, "Decode attention"). It is not PyTorch's rounding: nearer float32's (it keeps the
weights in float32, SDPA rounds them to bf16).

The C file is built for the node's CPU at first use (`native_build`). Without a compiler, or where the build fails,
`library()` is None and the step keeps PyTorch's operations. `RAYRUNNER_FUSED_OPS=0` turns the fused path off.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from rayrunner.runtime import native_build

SOURCE = Path(__file__).with_suffix(".c")
SWITCH_ENV = "RAYRUNNER_FUSED_OPS"
ATTENTION_HEAD_DIMS, ATTENTION_MAX_GROUP = (64, 128), 16  # what `decode_attention` is built for


@functools.cache
def library() -> ctypes.CDLL | None:
    """The fused operations, built if needed and loaded; None when switched off or not buildable here."""
    if os.environ.get(SWITCH_ENV, "1").strip() == "0":
        return None
    lib = native_build.load(SOURCE)
    if lib is None:
        return None
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    lib.add_rms_norm.argtypes = [pointer, pointer, pointer, pointer, i64, i64, ctypes.c_float]
    lib.add_rms_norm.restype = ctypes.c_int
    lib.rope.argtypes = [pointer, i64, pointer, pointer, pointer, i64, i64, i64]
    lib.rope.restype = None
    lib.silu_mul.argtypes = [pointer, i64, pointer, i64, i64, ctypes.c_int]
    lib.silu_mul.restype = None
    lib.has_decode_attention.argtypes = []
    lib.has_decode_attention.restype = ctypes.c_int
    lib.decode_attention.argtypes = [pointer, i64, pointer, pointer, i64, i64, pointer, i64, pointer, i64, i64, i64,
                                     i64, ctypes.c_float, ctypes.c_int]
    lib.decode_attention.restype = ctypes.c_int
    return lib


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


def attends(hidden: torch.Tensor, group: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes queries of `hidden`'s kind, `group` query heads a KV head of `head_dim`:
    bf16 on the CPU, the library built for a CPU with AVX-512 BF16, heads of 64 or 128, groups of up to 16."""
    lib = library() if applies(hidden) else None
    return (lib is not None and bool(lib.has_decode_attention()) and head_dim in ATTENTION_HEAD_DIMS
            and 1 <= group <= ATTENTION_MAX_GROUP)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one new position per row: `query` [rows, kv_heads, group, head_dim] (rows may be strided) over
    `keys` and `values` [rows, kv_heads, positions, head_dim] (views of the cache's room, strided alike), with the
    additive float32 `bias` [rows, 1, 1, positions] (-inf where not attended); [rows, kv_heads, group, head_dim].
    Takes what `attends` says."""
    lib = _ready(query)
    rows, kv_heads, group, dim = query.shape
    positions = keys.shape[2]
    if not attends(query, group, dim) or query.stride()[1:] != (group * dim, dim, 1):
        raise ValueError(f"query {tuple(query.shape)} strided {query.stride()}: heads of 64 or 128, contiguous rows")
    if (keys.shape != (rows, kv_heads, positions, dim) or values.shape != keys.shape
            or keys.stride() != values.stride() or keys.stride()[2:] != (dim, 1)):
        raise ValueError(f"keys {tuple(keys.shape)} {keys.stride()} and values {tuple(values.shape)} "
                         f"{values.stride()} do not fit the query {tuple(query.shape)}")
    if bias.shape != (rows, 1, 1, positions) or bias.dtype != torch.float32 or not bias.is_contiguous():
        raise ValueError(f"bias {tuple(bias.shape)} {bias.dtype}: float32 [{rows}, 1, 1, {positions}], contiguous")
    out = torch.empty((rows, kv_heads, group, dim), dtype=query.dtype)
    status = lib.decode_attention(query.data_ptr(), query.stride(0), keys.data_ptr(), values.data_ptr(),
                                  keys.stride(0), keys.stride(1), bias.data_ptr(), positions, out.data_ptr(), rows,
                                  kv_heads, group, dim, scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"no memory for the scores of {group} heads over {positions} positions")
    return out


def _ready(x: torch.Tensor) -> ctypes.CDLL:
    """The library, for a tensor `applies` takes."""
    lib = library()
    if lib is None or not applies(x):
        raise ValueError(f"the fused operations take bf16 CPU tensors where built, not {x.dtype} on {x.device}")
    return lib
