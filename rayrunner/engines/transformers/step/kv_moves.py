"""The step scheduler's moves within its KV memory budget (`kv_memory`), apart from its steps: which prompts start
from cached blocks, whether a group fits, making room (the prefix cache gives way, then the newest sequences are
preempted), and leaving a sequence's blocks in the prefix cache. A base class of `StepScheduler`, which holds the
state these read and change.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from rayrunner.engines.transformers.kv.kv_batch import MIN_ROOM, BatchCache, new_cache
from rayrunner.engines.transformers.kv.kv_memory import KvMemory, cache_bytes
from rayrunner.engines.transformers.kv.prefix_cache import BLOCK, LayerKV, cache_of
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.errors import InvalidRequestError
from rayrunner.runtime import metrics

logger = logging.getLogger(__name__)


class KvMoves:
    """What `StepScheduler` does about KV memory; the attributes below are the scheduler's."""

    model: Any
    model_id: str | None
    device: torch.device
    memory: KvMemory
    _cond: threading.Condition
    _waiting: collections.deque[Sequence]
    _running: list[Sequence]
    _batch: BatchCache | None
    _chunking: tuple[Sequence, BatchCache] | None
    _found: dict[int, list[LayerKV]]  # by id(sequence): cached blocks its prompt starts with

    def _free_slots(self) -> int:
        raise NotImplementedError

    def _retire(self) -> None:
        raise NotImplementedError

    def _empty_mask(self, rows: int) -> torch.Tensor:
        return torch.zeros((rows, 0), dtype=torch.long, device=self.device)

    def _find_prefixes(self) -> None:
        """How many tokens of each sequence that may start next are in the prefix cache (call with the lock held)."""
        self._found.clear()
        if self.memory.prefix is None:
            return
        for sequence in list(self._waiting)[: max(self._free_slots(), 1)]:
            blocks = self.memory.prefix.lookup(sequence.prefill_ids, sequence.namespace) if sequence.reusable else []
            sequence.prefilled = len(blocks) * BLOCK
            if blocks:
                self._found[id(sequence)] = blocks

    def _chunk_cache(self, sequence: Sequence) -> BatchCache:
        """The cache a chunked prefill starts from: the cached blocks its prompt starts with, or nothing."""
        blocks = self._found.get(id(sequence))
        if not blocks:
            sequence.prefilled = 0
            return BatchCache(new_cache(self.model.config), self._empty_mask(1))
        if not sequence.resumed:
            sequence.cached_tokens = sequence.prefilled
        mask = torch.ones((1, sequence.prefilled), dtype=torch.long, device=self.device)
        return BatchCache(cache_of(blocks), mask)

    def _fits(self, group: list[Sequence], alone: bool = False) -> bool:
        """Whether the KV budget has room for `group` to start now (`alone`: with nothing else running): its
        prefill beside the batch, and the merged batch with some room to grow."""
        rows = sum(s.slots for s in group)
        longest = max(len(s.prefill_ids) for s in group) + MIN_ROOM
        if alone or self._batch is None:
            return self.memory.within(self.memory.bytes_of(rows, longest))
        batch = self._batch
        merged = self.memory.bytes_of(batch.rows + rows, max(batch.length + MIN_ROOM, longest))
        beside = cache_bytes(batch.cache) + self.memory.bytes_of(rows, longest)
        return self.memory.within(max(merged, beside))

    def _refuse(self, sequence: Sequence) -> None:
        """A sequence that cannot fit the KV budget even alone: a prompt is refused (400); a resumed sequence (its
        output grew it past the budget) ends with finish_reason `length`."""
        if sequence.resumed:
            sequence.finish_length()
            return
        needed = self.memory.bytes_of(sequence.slots, len(sequence.prompt_ids) + MIN_ROOM)
        sequence.fail(InvalidRequestError(
            f"the prompt's {len(sequence.prompt_ids)} tokens (x{sequence.slots} choices) need {needed:,} bytes of KV "
            f"cache, more than this model's budget of {self.memory.limit:,} (engine.kv_cache_bytes)",
            param="messages"))

    def _merged_bytes(self, cache: BatchCache) -> int:
        if self._batch is None:
            return cache_bytes(cache.cache)
        return self.memory.bytes_of(self._batch.rows + cache.rows, max(self._batch.length, cache.length))

    def _bytes_after_step(self) -> int:
        """What the batch and a prompt being chunked will hold after the next decode step (the batch's new room
        kept within what the budget leaves it)."""
        chunking = self._chunking
        held = self.memory.bytes_of(1, len(chunking[0].prefill_ids) + MIN_ROOM) if chunking else 0
        batch = self._batch
        if batch is None:
            return held
        per_row = (self.memory.limit - held) // batch.rows - self.memory.row_bytes
        batch.max_positions = max(per_row // max(self.memory.position_bytes, 1), 0)
        positions = batch.positions_after_step()
        return held + (cache_bytes(batch.cache) if positions is None else self.memory.bytes_of(batch.rows, positions))

    def _make_room(self, needed: Callable[[], int], finish_alone: bool = False) -> None:
        """Make room in the KV budget for `needed()` bytes: the prefix cache gives way, then the newest sequences
        are preempted (a prompt being chunked first); a running sequence left alone without room ends (`length`)
        when `finish_alone`."""
        while not self.memory.make_room(needed()):
            if self._chunking is not None:
                self._preempt(self._chunking[0])
            elif len(self._running) > 1 or (self._running and not finish_alone):
                self._preempt(self._running[-1])
            else:
                if self._running:
                    self._running[0].finish_length()
                    self._retire()
                return

    def _preempt(self, sequence: Sequence) -> None:
        """Drop `sequence`'s cache; it waits at the head of the queue to be prefilled again."""
        with self._cond:
            if self._chunking is not None and self._chunking[0] is sequence:
                self._chunking = None
            else:
                index = self._running.index(sequence)
                self._running.pop(index)
                if self._batch is not None:
                    if self._running:
                        self._batch.keep([i for i in range(len(self._running) + 1) if i != index])
                    else:
                        self._batch = None
            sequence.prefilled = 0
            self._waiting.appendleft(sequence)
        self.memory.preemptions += 1
        if self.model_id is not None:
            metrics.preempted(self.model_id)
        logger.info("KV budget full: a sequence of %d tokens is preempted (recomputed later)",
                    len(sequence.prefill_ids))

    def _keep_prefix(self, sequence: Sequence, cache: BatchCache, row: int) -> None:
        """Leave the full blocks of the tokens `cache` holds for `sequence` (row `row`) in the prefix cache, as far
        as the KV budget has room beside what runs."""
        prefix = self.memory.prefix
        if prefix is None or not sequence.reusable or sequence.failed:
            return
        ids = (sequence.prompt_ids + sequence.output_ids)[: int(cache.mask[row].sum())]
        held = self._bytes_after_step() + (cache_bytes(cache.cache) if cache is not self._batch else 0)
        prefix.store(ids, sequence.namespace, lambda start, end: cache.row_kv(row, start, end),
                     lambda nbytes: self.memory.make_room(held + nbytes))
