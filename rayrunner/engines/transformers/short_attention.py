"""Attention of short prompts on CPU as two matmuls, where PyTorch's `scaled_dot_product_attention` is slower.

For a prompt of ~100 tokens PyTorch's CPU SDPA kernels (flash and the masked one alike) take ~1.8x as long as a
matmul of the queries by the keys, a float32 softmax and a matmul by the values, the GQA groups folded into the query
rows so that keys and values are never repeated; past ~20,000 query-by-key positions per row and head the flash
kernel is faster (figures in docs/performance.md, "Prefill"). So CPU models that would run transformers' `sdpa`
attention run `short_attention_forward` instead (`use_short_attention`, at load): the two matmuls for short
attention, transformers' own `sdpa_attention_forward` for anything longer or beyond what it covers (dropout, soft
capping, attention sinks, position biases, attention weights asked for). Masks are `sdpa`'s (booleans, or None for a
plain causal prompt); the arithmetic is eager attention's (scores in the model's dtype, softmax in float32).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "rayrunner_short"
MAX_SCORES = 20_000  # query x key positions per row and head up to which the two matmuls beat SDPA (see above)
_UNCOVERED = ("softcap", "s_aux", "sinks", "position_bias")


def short_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query` [batch, heads, q, dim], `key`/`value` [batch, kv_heads, kv, dim];
    the output [batch, q, heads, dim]."""
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = attention_mask is None and q_length > 1 and kwargs.get("is_causal", getattr(module, "is_causal", True))
    covered = (query.device.type == "cpu" and q_length * kv_length <= MAX_SCORES and not dropout
               and query.shape[1] % key.shape[1] == 0 and not (causal and kv_length != q_length)
               and not kwargs.get("output_attentions") and all(kwargs.get(name) is None for name in _UNCOVERED))
    if not covered:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if causal:
        attention_mask = torch.ones((q_length, kv_length), dtype=torch.bool, device=query.device).tril()[None, None]
    return _two_matmuls(query, key, value, attention_mask, query.shape[-1] ** -0.5 if scaling is None else scaling)


def _two_matmuls(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float) -> tuple[torch.Tensor, None]:
    batch, heads, q_length, dim = query.shape
    kv_heads, kv_length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * q_length, dim)  # head h reads kv head h // group
    scores = torch.matmul(grouped, key.transpose(-1, -2)).view(batch, kv_heads, group, q_length, kv_length)
    scores = scores.float().mul_(scaling)
    if mask is not None:
        scores += _bias(mask)[:, :, None]  # [batch, 1, 1, q, kv]
    weights = scores.softmax(dim=-1).to(value.dtype).view(batch, kv_heads, group * q_length, kv_length)
    out = torch.matmul(weights, value).view(batch, heads, q_length, dim)
    return out.transpose(1, 2).contiguous(), None


def _bias(mask: torch.Tensor) -> torch.Tensor:
    """An additive float32 bias from `sdpa`'s mask (True: attend). Hidden positions get float32's lowest finite
    value, not -inf: a query that attends to nothing (left padding) gets finite weights, not NaNs."""
    if mask.dtype != torch.bool:
        return mask.float()
    lowest = torch.finfo(torch.float32).min
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, lowest)


AttentionInterface.register(NAME, short_attention_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_short_attention(model: Any) -> bool:
    """Run `short_attention_forward` in a CPU model that runs transformers' `sdpa` attention; whether it does now."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True
