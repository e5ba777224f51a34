"""The step scheduler's planner: what the next step does, decided from plain figures and nothing else.

Its inputs are the waiting sequences (their sizes, adapters, and the tokens their start finds in the prefix cache),
the running ones, the free sequence slots, and the KV memory's figures (`KvState`: the budget, the prefix cache's
bytes, the running batch's shape). Its answers, frozen dataclasses of sequence references and counts, say
- what starts from the head of the queue (`admit`: `Admission`'s policy within the KV budget): whole prompts fed
  through the fast step `Beside` the decode rows (or on their own), a `Group` of other whole prompts, the first
  `Chunk` of a long prompt or of one that starts from cached blocks, or a `Refuse` of a prompt
  that cannot fit even alone; and which `Chunk` of the prompt being chunked is fed next (`next_chunk`);
- what makes `Room` for a move (a decode step, or a prefilled cache joining the batch): how many prefix-cache bytes
  give way, and when that is not enough, which sequence is preempted (the prompt being chunked first, then the newest
  running one: the oldest streams keep going) or that a sequence left alone without room ends.
It touches no tensor and changes nothing. The step scheduler carries its answers out with the model runner, as
vLLM's scheduler hands a `SchedulerOutput` to its model runner; so the policy is tested on plain sequences, with no
model (tests/engines/test_planner.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rayrunner.engines.transformers.kv.kv_budget import MIN_ROOM, BatchShape, KvBudget, grown
from rayrunner.engines.transformers.step.admission import Admission, Waiting

S = TypeVar("S", bound=Waiting)


@dataclass(frozen=True)
class KvState:
    """The KV memory as the planner sees it: the budget's figures, and the running batch's cache (None: none)."""

    budget: KvBudget
    batch: BatchShape | None = None
    aside: int = 0  # bytes of the prompts being prefilled in the prefill thread (they join the batch later)


@dataclass(frozen=True)
class Group(Generic[S]):
    """Whole prompts from the head of the queue, prefilled together as one left-padded batch."""

    sequences: tuple[S, ...]


@dataclass(frozen=True)
class Chunk(Generic[S]):
    """Tokens `start` to `end` of `sequence`'s prefill, fed on a cache of its own. `first`: it is taken from the head
    of the queue now, its cache starting from the `start` tokens found in the prefix cache; `last`: its prefill ends
    with this chunk (it then joins the running batch)."""

    sequence: S
    start: int
    end: int
    first: bool
    last: bool

    @property
    def spans(self) -> list[tuple[S, int, int]]:
        """The prompt it feeds and its tokens' span (sequence, start, end)."""
        return [(self.sequence, self.start, self.end)]


@dataclass(frozen=True)
class Beside(Generic[S]):
    """Whole prompts from the head of the queue, fed beside the next decode step, or together on their own when no
    rows decode (each on a cache of its own, starting from the tokens `starts[i]` found in the prefix cache); they
    join the running batch after it."""

    sequences: tuple[S, ...]
    starts: tuple[int, ...]

    @property
    def spans(self) -> list[tuple[S, int, int]]:
        """The prompts it feeds and their tokens' spans (sequence, start, end)."""
        return [(s, start, len(s.prefill_ids)) for s, start in zip(self.sequences, self.starts, strict=True)]


@dataclass(frozen=True)
class Refuse(Generic[S]):
    """The head of the queue, which cannot fit the KV budget even alone: it needs `needed` bytes."""

    sequence: S
    needed: int


@dataclass(frozen=True)
class Room(Generic[S]):
    """What makes room for a move that will hold `needed` bytes beside the prefix cache: `evict` bytes of prefix
    blocks give way; when the move still does not `fit`, `preempt` is preempted (then plan again), or `finish`, left
    alone, ends; with neither, the move goes ahead as it is. `max_positions`: the most positions per row the batch
    may reserve at the decode step (its share of the budget; None: no batch)."""

    needed: int
    fits: bool
    evict: int = 0
    preempt: S | None = None
    finish: S | None = None
    max_positions: int | None = None


class Planner:
    """The policy of one step scheduler: its `admission` rules, within the KV budget."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def admit(self, waiting: Sequence[S], cached: Sequence[int], running: Sequence[Waiting], free_slots: int,
              kv: KvState, mixes: Callable[[S], bool] | None = None
              ) -> Group[S] | Chunk[S] | Beside[S] | Refuse[S] | None:
        """What starts from the head of `waiting` (those that may start: `free_slots` of them, at least one), beside
        `running`; `cached[i]`: the tokens `waiting[i]`'s start finds in the prefix cache (missing: none);
        `mixes(s)`: whether `s`'s prompt can be fed with others through the fast step, beside the decode rows or on
        their own (None: never)."""
        found = [_Found(s, cached[i] if i < len(cached) else 0) for i, s in enumerate(waiting)]
        fits = functools.partial(_fits, kv=kv)
        if mixes is not None:
            count = self.admission.beside(found, free_slots, fits, lambda f: mixes(f.sequence))
            if count:
                return Beside(tuple(f.sequence for f in found[:count]), tuple(f.prefilled for f in found[:count]))
        count = self.admission.group(found, running, free_slots, fits)
        if count == 0:
            if found and not _fits(found[:1], kv, alone=True):
                head = found[0]
                return Refuse(head.sequence, kv.budget.bytes_of(head.slots, len(head.prefill_ids) + MIN_ROOM))
            return None
        if count == 1 and self.admission.chunked(found[0]):
            return self._chunk(found[0].sequence, found[0].prefilled, first=True)
        return Group(tuple(waiting[:count]))

    def next_chunk(self, sequence: S) -> Chunk[S]:
        """The next chunk of the prompt being chunked, after the `prefilled` tokens its cache holds."""
        return self._chunk(sequence, sequence.prefilled, first=False)

    def room_for_step(self, kv: KvState, running: Sequence[S], chunking: S | None) -> Room[S]:
        """Room for the next decode step of `running` (the batch's rows, oldest first) beside `chunking`, the prompt
        being chunked; a sequence alone that cannot grow ends."""
        needed, max_positions = _after_step(kv, chunking)
        return _room(needed, kv.budget, running, chunking, finish_alone=True, max_positions=max_positions)

    def room_to_join(self, kv: KvState, joining: BatchShape, running: Sequence[S]) -> Room[S]:
        """Room for a prefilled cache (`joining`) to join the batch of `running`: the merged batch (left padding to
        the longer), or the new cache alone."""
        batch = kv.batch
        needed = joining.nbytes if batch is None else \
            kv.budget.bytes_of(batch.rows + joining.rows, max(batch.length, joining.length))
        return _room(needed, kv.budget, running, None, finish_alone=False)

    def held_after_step(self, kv: KvState, chunking: Waiting | None) -> int:
        """What the batch and the prompt being chunked will hold after the next decode step: the room a prefix may
        not take when blocks are kept."""
        return _after_step(kv, chunking)[0]

    def _chunk(self, sequence: S, start: int, first: bool) -> Chunk[S]:
        total = len(sequence.prefill_ids)
        end = min(start + self.admission.chunk_tokens, total)
        return Chunk(sequence, start, end, first, end == total)


def _fits(group: Sequence[Waiting], kv: KvState, alone: bool = False) -> bool:
    """Whether the KV budget has room for `group` to start now (`alone`: with nothing else running): its prefill
    beside the batch, and the merged batch with some room to grow."""
    budget, batch = kv.budget, kv.batch
    rows = sum(s.slots for s in group)
    longest = max(len(s.prefill_ids) for s in group) + MIN_ROOM
    if alone or batch is None:
        return budget.within(budget.bytes_of(rows, longest))
    merged = budget.bytes_of(batch.rows + rows, max(batch.length + MIN_ROOM, longest))
    beside = batch.nbytes + budget.bytes_of(rows, longest)
    return budget.within(max(merged, beside))


def _after_step(kv: KvState, chunking: Waiting | None) -> tuple[int, int | None]:
    """The bytes the batch and a prompt being chunked hold after the next decode step, and the most positions per
    row the batch may reserve then (what the budget leaves each row, so new room stays within it)."""
    budget, batch = kv.budget, kv.batch
    held = kv.aside + (budget.bytes_of(1, len(chunking.prefill_ids) + MIN_ROOM) if chunking is not None else 0)
    if batch is None:
        return held, None
    per_row = (budget.limit - held) // batch.rows - budget.row_bytes
    max_positions = max(per_row // max(budget.position_bytes, 1), 0)
    if batch.room_left:  # the step writes into room the batch holds: it holds what it holds now
        return held + batch.nbytes, max_positions
    return held + budget.bytes_of(batch.rows, grown(batch.length, max_positions)), max_positions


def _room(needed: int, budget: KvBudget, running: Sequence[S], chunking: S | None, finish_alone: bool,
          max_positions: int | None = None) -> Room[S]:
    """Room for `needed` bytes: prefix blocks give way first (the least recently used, as many as it takes, all of
    them when that is not enough); then the prompt being chunked is preempted (it holds no stream up yet), then the
    newest running sequence; one left alone ends when `finish_alone`, else the move goes ahead."""
    evict = min(max(needed + budget.prefix_bytes - budget.limit, 0), budget.prefix_bytes)
    if budget.within(needed):
        return Room(needed, True, evict, max_positions=max_positions)
    if chunking is not None:
        return Room(needed, False, evict, preempt=chunking, max_positions=max_positions)
    if len(running) > 1 or (running and not finish_alone):
        return Room(needed, False, evict, preempt=running[-1], max_positions=max_positions)
    return Room(needed, False, evict, finish=running[0] if running else None, max_positions=max_positions)


@dataclass(frozen=True)
class _Found(Generic[S]):
    """A waiting sequence as admission sees it: `prefilled`, the tokens its start finds in the prefix cache."""

    sequence: S
    prefilled: int

    @property
    def extra_inputs(self) -> dict[str, Any]:
        return self.sequence.extra_inputs

    @property
    def adapter(self) -> str | None:
        return self.sequence.adapter

    @property
    def prefill_ids(self) -> list[int]:
        return self.sequence.prefill_ids

    @property
    def slots(self) -> int:
        return self.sequence.slots

    @property
    def scores_prompt(self) -> bool:
        return self.sequence.scores_prompt
