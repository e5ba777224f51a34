"""A KV cache shared by the sequences of a running batch, which rows enter and leave between steps.

Rows are left-padded to a common length and carry an attention mask of their real tokens, so a new sequence's
prefilled cache joins by padding (never by recomputing anyone's keys and values) and a finished one leaves by
dropping its row. Columns that have become padding in every row are trimmed away. This needs transformers' plain
full-attention cache layers (`DynamicLayer`); models with sliding-window or other layer kinds run one sequence at a
time (`mergeable` tells which).
"""

from __future__ import annotations

from typing import Protocol, cast

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def new_cache(config: object) -> DynamicCache:
    return DynamicCache(config=config)  # type: ignore[arg-type]


def mergeable(config: object) -> bool:
    """Whether rows of this model's cache can be padded, joined and dropped (plain full-attention layers only)."""
    return all(type(layer) is DynamicLayer for layer in new_cache(config).layers)


class BatchCache:
    """The KV cache of a batch of sequences, with the mask of which cached positions are real tokens."""

    def __init__(self, cache: DynamicCache, mask: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask  # [rows, length]: 1 for a real token, 0 for left padding

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def next_positions(self) -> torch.Tensor:
        """Each row's position for the token it feeds next: the count of its real cached tokens."""
        return self.mask.sum(dim=1, keepdim=True)

    def mask_with(self, new_tokens: int) -> torch.Tensor:
        """The attention mask for a forward pass that adds `new_tokens` real tokens to every row."""
        ones = torch.ones(self.rows, new_tokens, dtype=self.mask.dtype, device=self.mask.device)
        return torch.cat([self.mask, ones], dim=1)

    def grew(self, mask: torch.Tensor) -> None:
        """Record the mask of the forward pass that just appended to the cache."""
        self.mask = mask

    def merge(self, other: BatchCache) -> None:
        """Append `other`'s rows, left-padding whichever side is shorter."""
        length = max(self.length, other.length)
        for mine, theirs in zip(_layers(self.cache), _layers(other.cache), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, length), _pad_left(theirs.keys, length)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, length), _pad_left(theirs.values, length)], dim=0)
        self.mask = torch.cat([_pad_left(self.mask, length), _pad_left(other.mask, length)], dim=0)

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order), then drop the columns that are padding in all of them."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        shared_padding = int((self.mask.shape[1] - self.mask.sum(dim=1)).min()) if rows else 0
        self.mask = self.mask[:, shared_padding:]
        for layer in _layers(self.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, shared_padding:]
            layer.values = layer.values.index_select(0, index)[:, :, shared_padding:]


def _layers(cache: DynamicCache) -> list[_FilledLayer]:
    """The cache's layers, each already holding keys and values (a BatchCache exists only after a prefill)."""
    return cast(list[_FilledLayer], cache.layers)


class _FilledLayer(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


def _pad_left(tensor: torch.Tensor, length: int) -> torch.Tensor:
    """Zero-pad `tensor` at the front of its sequence dimension (-2 for keys/values, -1 for a mask) to `length`."""
    if tensor.dim() == 2:
        return F.pad(tensor, (length - tensor.shape[1], 0))
    return F.pad(tensor, (0, 0, length - tensor.shape[-2], 0))
