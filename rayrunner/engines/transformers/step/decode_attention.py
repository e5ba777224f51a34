"""The attention of a decode step's rows (one new position a row) in one call, on CPUs with AVX-512 BF16, compiled
from `decode_attention.c` on first use (`native_build`).

The scores come from the CPU's bf16 dot-product instruction, 16 positions summed at once; the softmax is in float32;
the values are weighed in float32 registers and rounded to bf16 once; each head's values are fetched into cache while
its keys are scored. PyTorch's flash SDPA runs the same at a few rows as blocked matmuls sized for prompts, at about
half the memory's speed (docs/performance.md, "Fused operations"). It does not round as PyTorch does: it is nearer
float32 attention (it keeps the weights in float32, SDPA rounds them to bf16). `RAYRUNNER_FUSED_OPS=0` turns it off
with the other fused operations; without a compiler the step keeps SDPA.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from rayrunner.engines.transformers.step.fused_ops import SWITCH_ENV
from rayrunner.runtime import native_build

SOURCE = Path(__file__).with_suffix(".c")
HEAD_DIMS, MAX_GROUP = (64, 128), 16  # what the kernel is built for


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built if needed and loaded; None when switched off, not buildable here, or built for a CPU
    without AVX-512 BF16."""
    pointer, i64 = native_build.POINTER, native_build.I64
    lib = native_build.load(SOURCE, SWITCH_ENV, {
        "has_decode_attention": ([], ctypes.c_int),
        "decode_attention": ([pointer, i64, pointer, pointer, i64, i64, pointer, i64, pointer, i64, i64, i64, i64,
                              ctypes.c_float, ctypes.c_int], ctypes.c_int)})
    return lib if lib is not None and lib.has_decode_attention() else None


def attends(hidden: torch.Tensor, group: int, head_dim: int) -> bool:
    """Whether `decode_attention` takes queries of `hidden`'s kind, `group` query heads a KV head of `head_dim`:
    bf16 on the CPU, the kernel built, heads of 64 or 128, groups of up to 16."""
    return (hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and head_dim in HEAD_DIMS
            and 1 <= group <= MAX_GROUP and library() is not None)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Attention of one new position per row: `query` [rows, kv_heads, group, head_dim] (rows may be strided) over
    `keys` and `values` [rows, kv_heads, positions, head_dim] (views of the cache's room, strided alike), with the
    additive float32 `bias` [rows, 1, 1, positions] (-inf where not attended); [rows, kv_heads, group, head_dim].
    Takes what `attends` says."""
    rows, kv_heads, group, dim = query.shape
    positions = keys.shape[2]
    lib = library()
    if lib is None or not attends(query, group, dim) or query.stride()[1:] != (group * dim, dim, 1):
        raise ValueError(f"query {tuple(query.shape)} {query.dtype} strided {query.stride()}: bf16 on a CPU with the "
                         "kernel, heads of 64 or 128, contiguous rows")
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
