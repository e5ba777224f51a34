"""The KV memory budget's arithmetic on plain figures, with no tensor: what rows of cached positions hold, how far a
batch's reserved room grows, and the shape of a batch's cache as numbers.

The step planner (`step.planner`) decides with these; `kv_memory` (the budget, measured) and `kv_batch` (the room it
reserves) count with the same rules, so a plan and what the tensors then hold agree.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_ROOM = 16  # positions reserved ahead at least (`kv_batch` says why)


def grown(length: int, max_positions: int | None) -> int:
    """Positions per row of the room a batch of `length` positions reserves when it next reallocates: an eighth more
    (at least `MIN_ROOM`), but within `max_positions` when the KV budget sets it (at least one more)."""
    positions = length + max(MIN_ROOM, length // 8)
    if max_positions is not None:
        positions = max(length + 1, min(positions, max_positions))
    return positions


@dataclass(frozen=True)
class KvBudget:
    """A KV budget of `limit` bytes, its costs (learnt by `KvMemory.probe`), and what the prefix cache holds in it
    now (`prefix_bytes`: blocks that give way before any sequence does)."""

    limit: int
    position_bytes: int  # one cached position of one row, over every layer
    row_bytes: int = 0  # one row's recurrent states, whatever its length (hybrid models)
    prefix_bytes: int = 0

    def bytes_of(self, rows: int, positions: int) -> int:
        return rows * (positions * self.position_bytes + self.row_bytes)

    def within(self, needed: int) -> bool:
        """Whether `needed` bytes (besides the prefix cache) fit the budget once the prefix cache gives way."""
        return needed <= self.limit


@dataclass(frozen=True)
class BatchShape:
    """A batch cache (`kv_batch.BatchCache`) as numbers: `rows` of `length` positions (left padding included), the
    bytes its storages hold now (reserved room included), and whether its next decode step writes into room it
    already holds (`room_left`: the step then allocates nothing)."""

    rows: int
    length: int
    nbytes: int
    room_left: bool = False
