"""Prefix reuse: the keys and values of prompt blocks already computed, found again by the tokens they hold.

Block hashing, as vLLM's prefix caching: token ids are cut into blocks of `BLOCK`; a block's key names its tokens and
its parent block's key (the first block's parent is the request's namespace: its LoRA adapter, which changes the
keys and values, and its `cache_salt`), so one key names a whole prefix. A sequence leaves the keys and values of its
full blocks here when its prefill ends and when it leaves the batch (copies: the batch's rows come and go); a new
sequence takes the longest run of blocks its prompt starts with and prefills only the rest (the last token always:
its logits give the first token). Exact: a reused position holds what prefilling it would compute (same tokens before
it, same position), so greedy replies are the same with and without reuse in float32 (in bf16, computed in a pass of
another shape, it can differ in the last bit, which can move a reply at a near-tie, as batching can). The least
recently used blocks are dropped first when the KV budget needs room; a lookup touches a prefix's blocks from its last
to its first, so a prefix is dropped from its end.

Only plain attention caches (`kv_batch.mergeable`), and only text: an image's placeholder tokens do not name the
image, and a prompt scored for logprobs needs every position's logits.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

BLOCK = 16  # tokens per block

BlockKV = torch.Tensor  # one block's keys and values, every layer's: [layers, 2, kv_heads, positions, head_dim]


@dataclass(frozen=True)
class _Block:
    parent: Hashable
    tokens: tuple[int, ...]
    kv: BlockKV
    nbytes: int


class PrefixCache:
    """Blocks of keys and values by the prefix they end; `nbytes` is what they hold."""

    def __init__(self) -> None:
        self._blocks: collections.OrderedDict[Hashable, _Block] = collections.OrderedDict()  # oldest use first
        self.nbytes = 0
        self._pinned: set[Hashable] = set()  # the blocks a `store` has kept so far: `room` does not drop them

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, ids: list[int], namespace: Hashable) -> list[BlockKV]:
        """The cached blocks `ids` starts with (most: all but its last token), first to last; touched as used."""
        found: list[tuple[Hashable, _Block]] = []
        for key, parent, tokens in _keys(ids[:-1], namespace):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
                break
            found.append((key, block))
        self._touch([key for key, _ in found])
        return [block.kv for _, block in found]

    def store(self, ids: list[int], namespace: Hashable, kv_of: Callable[[int, int], BlockKV],
              room: Callable[[int], bool]) -> None:
        """Keep the full blocks of `ids` not yet cached; `kv_of(start, end)` copies those positions' keys and
        values, `room(nbytes)` makes room in the KV budget or says there is none (then the rest is not kept)."""
        kept: list[Hashable] = []
        self._pinned = set()
        for index, (key, parent, tokens) in enumerate(_keys(ids, namespace)):
            block = self._blocks.get(key)
            if block is None or block.parent != parent or block.tokens != tokens:
                kv = kv_of(index * BLOCK, (index + 1) * BLOCK)
                nbytes = kv.nbytes
                if not room(nbytes):
                    break
                self._drop(key)
                self._blocks[key] = _Block(parent, tokens, kv, nbytes)
                self.nbytes += nbytes
            kept.append(key)
            self._pinned.add(key)
        self._pinned = set()
        self._touch(kept)

    def evict(self, nbytes: int) -> int:
        """Drop least recently used blocks until `nbytes` are freed (or none is left); the bytes freed."""
        freed = 0
        for key in [key for key in self._blocks if key not in self._pinned]:
            if freed >= nbytes:
                break
            freed += self._drop(key)
        return freed

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def _touch(self, prefix: list[Hashable]) -> None:
        """Mark a prefix's blocks used, its first block last: the least recently used block is a prefix's end."""
        for key in reversed(prefix):
            self._blocks.move_to_end(key, last=True)

    def _drop(self, key: Hashable) -> int:
        block = self._blocks.pop(key, None)
        if block is None:
            return 0
        self.nbytes -= block.nbytes
        return block.nbytes


def cache_of(blocks: list[BlockKV]) -> DynamicCache:
    """A one-row cache holding `blocks` one after another."""
    cache = DynamicCache()
    kv = torch.cat(blocks, dim=3)
    for layer in range(kv.shape[0]):
        cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
    return cache


def _keys(ids: list[int], namespace: Hashable) -> list[tuple[Hashable, Hashable, tuple[int, ...]]]:
    """(key, parent key, tokens) of each full block of `ids`."""
    parent: Hashable = ("namespace", namespace)
    keys: list[tuple[Hashable, Hashable, tuple[int, ...]]] = []
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        tokens = tuple(ids[start: start + BLOCK])
        key = hash((parent, tokens))
        keys.append((key, parent, tokens))
        parent = key
    return keys
