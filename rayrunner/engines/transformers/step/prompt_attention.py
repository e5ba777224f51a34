"""The causal attention of a prompt's tokens on the CPU's AMX tiles, compiled from `prompt_attention.c` on first use
(`native_build`): for whole prompts and chunks fed through the fast step (`PromptChunk`) in bf16.

PyTorch's flash SDPA takes 0.3-0.4 ms per 124-token prompt and layer of SmolLM2 on one Sapphire Rapids core (0.6-0.7
ms with the mask of a prompt after cached blocks), about a fifth of a 16-prompt wave's prefill (docs/performance.md,
"Prompt attention on the tiles"); this kernel computes what it computes in under half of that, and as it computes
it: scores and weighted values summed in float32 on the tiles, the softmax in float32 with PyTorch's own exponential
(`fexp_u20`) and the order of its sum, its weights rounded to bf16 before they weigh the values, the output times the
inverse of their total, rounded once. Its outputs are SDPA's to the bit but for about one in 20,000 (the last bit,
where oneDNN orders a float32 sum of weighted values differently), so a prompt's logits are transformers' own
prefill's. Up to `KEY_BLOCK` positions: past them PyTorch's softmax runs block by block, which this kernel does not,
so longer ones keep SDPA, as do CPUs without AMX or without a compiler, or with `RAYRUNNER_PROMPT_ATTENTION=0` in
the cluster's environment.

`prompts_attention` takes every prompt of one forward in one call a layer: each one's cached and new keys and values
are copied into a cache tensor of its own first: no concatenation layer by layer, no Python prompt by prompt
(docs/performance.md, "Prompt attention on the tiles").
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from rayrunner.quantization.cpu_gemm import amx_tiles
from rayrunner.runtime import native_build

SOURCE = Path(__file__).with_suffix(".c")
SWITCH_ENV = "RAYRUNNER_PROMPT_ATTENTION"
HEAD_DIMS = (64, 128)  # what the kernel is built for
KEY_BLOCK = 512  # PyTorch's flash attention's block of keys on CPU: the softmax of one block is one pass
PROMPT_FIELDS = 10  # a prompt's row of a `prompts_attention` table (`prompts_attention` in prompt_attention.c)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel, built if needed and loaded; None when switched off, on CPUs without AMX tiles, or where it cannot
    be built."""
    if not amx_tiles():
        return None
    pointer, i64 = native_build.POINTER, native_build.I64
    lib = native_build.load(SOURCE, SWITCH_ENV, {
        "prompt_tiles_ready": ([], ctypes.c_int),
        "prompt_attention": ([pointer, i64, i64, i64, pointer, pointer, i64, pointer, i64, i64, i64, i64,
                              ctypes.c_float, ctypes.c_int], ctypes.c_int),
        "prompts_attention": ([i64, pointer, pointer, i64, pointer, i64, pointer, i64, i64, i64, i64, ctypes.c_float,
                               ctypes.c_int], ctypes.c_int)})
    return lib if lib is not None and lib.prompt_tiles_ready() else None


def attends(query: torch.Tensor, heads: int, kv_heads: int, head_dim: int, positions: int) -> bool:
    """Whether `prompt_attention` takes a prompt's queries of `query`'s kind over `positions` keys: bf16 on the CPU,
    the kernel built, heads of 64 or 128, whole groups of query heads per KV head, one block of keys."""
    return (query.dtype == torch.bfloat16 and query.device.type == "cpu" and head_dim in HEAD_DIMS
            and heads % kv_heads == 0 and positions <= KEY_BLOCK and library() is not None)


def prompt_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                     scale: float) -> torch.Tensor:
    """Causal attention of a prompt's `query` [tokens, heads, head_dim] (token i at position start + i; tokens may be
    strided) over `keys` and `values` [kv_heads, start + tokens, head_dim] (contiguous): [tokens, heads * head_dim].
    Takes what `attends` says."""
    tokens, heads, dim = query.shape
    kv_heads, positions = keys.shape[0], start + tokens
    lib = library()
    if lib is None or not attends(query, heads, kv_heads, dim, positions) or query.stride()[1:] != (dim, 1):
        raise ValueError(f"query {tuple(query.shape)} {query.dtype} strided {query.stride()}: bf16 on a CPU with "
                         f"the kernel, heads of 64 or 128, contiguous heads, at most {KEY_BLOCK} positions")
    for name, tensor in (("keys", keys), ("values", values)):
        if tensor.shape != (kv_heads, positions, dim) or tensor.dtype != query.dtype or not tensor.is_contiguous():
            raise ValueError(f"{name} {tuple(tensor.shape)} {tensor.dtype}: contiguous [{kv_heads}, {positions}, "
                             f"{dim}] for {tokens} tokens after {start}")
    out = torch.empty((tokens, heads * dim), dtype=query.dtype)
    status = lib.prompt_attention(query.data_ptr(), query.stride(0), tokens, start, keys.data_ptr(),
                                  values.data_ptr(), positions * dim, out.data_ptr(), heads * dim, heads, kv_heads,
                                  dim, scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"no memory for the attention of {tokens} tokens over {positions} positions")
    return out


def prompts_attention(table: torch.Tensor, rotated: torch.Tensor, values: torch.Tensor, tokens: int,
                      scale: float) -> torch.Tensor:
    """One layer's attention of several prompts fed in one forward, in one call: `table` [prompts, PROMPT_FIELDS]
    (int64) says where each prompt's rows of `rotated` [rows, heads + kv_heads, head_dim] (queries, then rotated
    keys) and of `values` [rows, kv_heads, head_dim] are, which cache of its own they are written into (after its
    cached positions) and where its output rows go; the output [tokens, heads * head_dim], the prompts' rows in the
    table's order. Each prompt as `prompt_attention` would compute it (`attends` must hold for each)."""
    lib = library()
    kv_heads, dim = values.shape[1:]
    heads = rotated.shape[1] - kv_heads
    if lib is None or rotated.stride()[1:] != (dim, 1) or values.stride()[1:] != (dim, 1) \
            or table.dtype != torch.int64 or not table.is_contiguous() or table.shape[1] != PROMPT_FIELDS:
        raise ValueError(f"rotated {tuple(rotated.stride())}, values {tuple(values.stride())} strided, table "
                         f"{tuple(table.shape)} {table.dtype}: contiguous heads, an int64 row of {PROMPT_FIELDS} a "
                         "prompt, and the kernel built")
    out = torch.empty((tokens, heads * dim), dtype=rotated.dtype)
    status = lib.prompts_attention(table.shape[0], table.data_ptr(), rotated.data_ptr(), rotated.stride(0),
                                   values.data_ptr(), values.stride(0), out.data_ptr(), heads * dim, heads, kv_heads,
                                   dim, scale, torch.get_num_threads())
    if status != 0:
        raise MemoryError(f"no memory for the attention of {tokens} prompt tokens")
    return out
