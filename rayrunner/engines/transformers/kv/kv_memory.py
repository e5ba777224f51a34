"""The KV memory budget of one scheduler: what its caches may hold, and what they hold.

Three things hold keys and values: the running batch (`BatchCache`: rows times the positions its tensors hold, left
padding and reserved room included), the cache of a prompt being prefilled, and the prefix cache (`PrefixCache`).
Before each of the step scheduler's moves its planner (`step.planner`, on `budget()`'s figures) says whether the
budget has room for what the move will hold; the prefix cache gives way first (least recently used blocks), then the
newest sequences are preempted: their caches are dropped and they wait at the head of the queue, to be prefilled
again from their prompt and output (vLLM's recompute preemption; their blocks are often still in the prefix cache).
A sequence alone that cannot grow ends with finish_reason `length`; a prompt that cannot fit at all is refused
(400). The caches never hold more than the budget; whether the device has that much is the budget's rule's business.

The default budget (`rayrunner.models.footprint`, the rule capacity counts too): on CPU, `CPU_KV_BYTES`; on a GPU,
`gpu_kv_budget` of the share of the device this replica reserved (`engine.num_gpus`), beside the tensors the
process holds once the weights are loaded, so the replicas sharing a GPU fit on it together. `measure` reads what
the caches' tensors really hold (their storages), which the metrics report and tests compare with the budget.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import DynamicCache

from rayrunner.engines.transformers.kv.kv_batch import new_cache
from rayrunner.engines.transformers.kv.kv_budget import KvBudget
from rayrunner.engines.transformers.kv.prefix_cache import PrefixCache
from rayrunner.models.footprint import CPU_KV_BYTES, GPU_KV_FRACTION, gpu_kv_budget

logger = logging.getLogger(__name__)


class KvMemory:
    """A budget of `limit` bytes (None: the default for `device` and the `gpu_share` this replica reserved), and the
    prefix cache that lives within it."""

    def __init__(self, limit: int | None, device: torch.device, prefix_caching: bool, gpu_share: float = 0.0) -> None:
        self.limit = limit if limit is not None else default_limit(device, gpu_share)
        self.prefix = PrefixCache() if prefix_caching else None
        self.position_bytes = 0  # one position of one row, over every layer (`probe`)
        self.row_bytes = 0  # one row's recurrent states, whatever its length (hybrid models)
        self.held = 0  # bytes held after the last step, measured
        self.peak = 0  # most bytes held after any step, measured
        self.preemptions = 0

    def probe(self, model: Any) -> None:
        """Learn the bytes of one cached position, and of a row's recurrent states, from forward passes of one and
        of two tokens (any architecture, any dtype)."""
        if self.position_bytes:
            return
        one, two = (_cache_after(model, tokens) for tokens in (1, 2))
        self.position_bytes = max(two - one, 1)
        self.row_bytes = max(one - self.position_bytes, 0)

    def budget(self) -> KvBudget:
        """The budget's figures now, as plain numbers (what the step planner decides with)."""
        return KvBudget(self.limit, self.position_bytes, self.row_bytes, self.prefix.nbytes if self.prefix else 0)

    def bytes_of(self, rows: int, positions: int) -> int:
        return self.budget().bytes_of(rows, positions)

    def evict(self, nbytes: int) -> None:
        """Drop at least `nbytes` of least recently used prefix blocks (or all there are)."""
        if nbytes > 0 and self.prefix is not None:
            self.prefix.evict(nbytes)

    def make_room(self, needed: int) -> bool:
        """Drop prefix blocks until `needed` bytes fit beside what stays cached; whether they fit."""
        prefix_bytes = self.prefix.nbytes if self.prefix is not None else 0
        excess = needed + prefix_bytes - self.limit
        if excess > 0 and self.prefix is not None:
            self.prefix.evict(excess)
            prefix_bytes = self.prefix.nbytes
        return needed + prefix_bytes <= self.limit

    def measure(self, caches: list[DynamicCache]) -> int:
        """Record the bytes `caches` and the prefix cache hold now; that figure."""
        self.held = sum(cache_bytes(cache) for cache in caches) + (self.prefix.nbytes if self.prefix else 0)
        self.peak = max(self.peak, self.held)
        return self.held


def default_limit(device: torch.device, gpu_share: float) -> int:
    """The default budget on `device`: `CPU_KV_BYTES` on CPU; on a GPU, `gpu_kv_budget` of this process's share and
    the tensors it holds there now (the weights)."""
    if device.type != "cuda":
        return CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_allocated(device)
    limit = gpu_kv_budget(total, free, held, gpu_share)
    if gpu_share <= 0:
        logger.warning("KV budget %s bytes: %g of the memory free on %s now; this replica reserved no share of the "
                       "GPU, so a replica that starts there later counts the same memory again (set engine.num_gpus "
                       "or engine.kv_cache_bytes)", f"{limit:,}", GPU_KV_FRACTION, device)
    else:
        logger.info("KV budget %s bytes: of this replica's share of %s (%g of %s bytes, %s held)", f"{limit:,}",
                    device, min(gpu_share, 1.0), f"{total:,}", f"{held:,}")
    return limit


def _cache_after(model: Any, tokens: int) -> int:
    cache = new_cache(model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, tokens), dtype=torch.long, device=model.device), cache=cache, use_cache=True)
    return cache_bytes(cache)


def cache_bytes(cache: DynamicCache) -> int:
    """Bytes the storages behind `cache`'s keys, values and recurrent states hold (reserved room included, each
    storage once)."""
    storages: dict[int, int] = {}
    for layer in cache.layers:
        states = [*getattr(layer, "conv_states", {}).values(), *getattr(layer, "recurrent_states", {}).values()]
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None), *states):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
