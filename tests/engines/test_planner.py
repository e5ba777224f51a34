"""The step planner on plain sequences and plain KV figures (no model, no tensor, no Ray): admission under the slot,
chunk and KV limits, refusals, chunked prefill, prefix reuse, and what makes room (which sequence is preempted, and
when); and that planning changes nothing and loads no torch."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from rayrunner.engines.transformers.kv.kv_budget import MIN_ROOM, BatchShape, KvBudget, grown
from rayrunner.engines.transformers.step.admission import Admission
from rayrunner.engines.transformers.step.planner import Beside, Chunk, Group, KvState, Planner, Refuse, Room
from tests.engines.test_admission import Seq

POSITION = 10  # bytes of one cached position of one row
ROOMY = KvState(KvBudget(limit=10**9, position_bytes=POSITION))


def planner(chunk_tokens: int = 512, max_adapters: int | None = None) -> Planner:
    return Planner(Admission(chunk_tokens, max_adapters))


def budget_of(positions: int, prefix_positions: int = 0) -> KvBudget:
    return KvBudget(positions * POSITION, POSITION, prefix_bytes=prefix_positions * POSITION)


def test_whole_prompts_start_together_within_the_free_slots_and_adapters() -> None:
    waiting = [Seq(20), Seq(30, forks=1), Seq(10)]
    plan = planner().admit(waiting, [], [], free_slots=3, kv=ROOMY)
    assert isinstance(plan, Group) and plan.sequences == tuple(waiting[:2])  # the forks take the third slot
    assert planner().admit(waiting, [], [], free_slots=0, kv=ROOMY) is None
    busy = planner(max_adapters=1).admit([Seq(5, adapter="b")], [], [Seq(5, adapter="a")], free_slots=4, kv=ROOMY)
    assert busy is None  # another adapter is in use: it waits, it is not refused


def test_a_group_stops_where_the_kv_budget_ends() -> None:
    waiting = [Seq(100), Seq(100), Seq(100)]
    two = budget_of(2 * (100 + MIN_ROOM))  # a prompt and its first room, twice
    plan = planner().admit(waiting, [], [], free_slots=8, kv=KvState(two))
    assert isinstance(plan, Group) and plan.sequences == tuple(waiting[:2])


def test_a_prompt_that_cannot_fit_even_alone_is_refused_with_what_it_needs() -> None:
    head = Seq(100, forks=2)
    short = budget_of(3 * (100 + MIN_ROOM) - 1)
    plan = planner().admit([head, Seq(5)], [], [], free_slots=8, kv=KvState(short))
    assert plan == Refuse(head, 3 * (100 + MIN_ROOM) * POSITION)


def test_beside_a_running_batch_a_prompt_that_fits_alone_waits() -> None:
    batch = BatchShape(rows=2, length=330, nbytes=2 * 346 * POSITION)
    kv = KvState(budget_of(1000), batch)
    assert planner().admit([Seq(100)], [], [Seq(330), Seq(300)], free_slots=6, kv=kv) is None  # merged: 3 x 346
    shorter = KvState(budget_of(1000), dataclasses.replace(batch, length=300, nbytes=2 * 316 * POSITION))
    assert isinstance(planner().admit([Seq(100)], [], [Seq(300)] * 2, free_slots=6, kv=shorter), Group)


def test_a_long_prompt_is_chunked_alone_one_chunk_at_a_time() -> None:
    long, short = Seq(100), Seq(5)
    plan = planner(chunk_tokens=32).admit([long, short], [], [], free_slots=8, kv=ROOMY)
    assert plan == Chunk(long, 0, 32, first=True, last=False)
    chunks: list[Chunk[Seq]] = []
    while not chunks or not chunks[-1].last:
        long.prefilled = chunks[-1].end if chunks else 32  # what the runner records after each chunk
        chunks.append(planner(chunk_tokens=32).next_chunk(long))
    assert [(c.start, c.end) for c in chunks] == [(32, 64), (64, 96), (96, 100)] and not any(c.first for c in chunks)
    group = planner(chunk_tokens=32).admit([short, long], [], [], free_slots=8, kv=ROOMY)
    assert group == Group((short,))  # the long one goes alone, at the next step


def test_a_prompt_whose_start_is_cached_starts_from_those_tokens_alone() -> None:
    a, b = Seq(40), Seq(40)
    assert planner().admit([a, b], [], [], free_slots=8, kv=ROOMY) == Group((a, b))
    assert planner().admit([a, b], [32, 0], [], free_slots=8, kv=ROOMY) == Chunk(a, 32, 40, first=True, last=True)
    assert planner().admit([a, b], [0, 32], [], free_slots=8, kv=ROOMY) == Group((a,))  # b then goes alone
    long = Seq(600)
    assert planner().admit([long], [512], [], free_slots=8, kv=ROOMY) == Chunk(long, 512, 600, first=True, last=True)


def test_beside_decoding_rows_whole_prompts_start_together_from_their_cached_tokens() -> None:
    a, b, c, image = Seq(40), Seq(40), Seq(30), Seq(10, extra_inputs={"pixel_values": 1})
    running = [Seq(5)]

    def admit(waiting: list[Seq], cached: list[int], chunk_tokens: int = 64, free_slots: int = 8,
              kv: KvState = ROOMY) -> object:
        return planner(chunk_tokens).admit(waiting, cached, running, free_slots, kv,
                                           mixes=lambda s: not s.extra_inputs)

    assert admit([a, b, c], [32, 0, 16]) == Beside((a, b, c), (32, 0, 16))  # 8 + 40 + 14 new tokens
    assert admit([a, b, c], [32, 0, 16], chunk_tokens=60) == Beside((a, b), (32, 0))
    assert admit([a, b, c], [32, 0, 16], free_slots=2) == Beside((a, b), (32, 0))
    assert admit([a, b, c], [32, 0, 16], kv=KvState(budget_of(2 * (40 + MIN_ROOM)))) == Beside((a, b), (32, 0))
    assert admit([image, a], []) == Group((image,))  # what cannot be fed beside starts as before
    long = Seq(100)
    assert admit([long, a], [], chunk_tokens=32) == Chunk(long, 0, 32, first=True, last=False)  # chunked as before


def test_room_for_a_step_takes_prefix_blocks_before_any_sequence() -> None:
    running = [Seq(100), Seq(100)]
    batch = BatchShape(rows=2, length=100, nbytes=800 * POSITION, room_left=True)
    room = planner().room_for_step(KvState(budget_of(1000, prefix_positions=300), batch), running, None)
    assert room == Room(800 * POSITION, True, evict=100 * POSITION, max_positions=500)
    roomy = planner().room_for_step(KvState(budget_of(1000, prefix_positions=200), batch), running, None)
    assert roomy.fits and roomy.evict == 0 and roomy.preempt is None


def test_the_chunked_prompt_is_preempted_first_then_the_newest_running() -> None:
    oldest, older, newest, chunking = Seq(100), Seq(100), Seq(100), Seq(200)
    kv = KvState(budget_of(100, prefix_positions=50), BatchShape(rows=3, length=100, nbytes=0))
    first = planner().room_for_step(kv, [oldest, older, newest], chunking)
    assert first.preempt is chunking and not first.fits and first.evict == 50 * POSITION  # every prefix block goes
    assert planner().room_for_step(kv, [oldest, older, newest], None).preempt is newest
    assert planner().room_to_join(kv, BatchShape(1, 10, 0), [oldest, older]).preempt is older


def test_one_sequence_left_that_cannot_grow_ends_and_a_joining_cache_goes_ahead() -> None:
    alone = Seq(100)
    kv = KvState(budget_of(100), BatchShape(rows=1, length=100, nbytes=0))
    assert planner().room_for_step(kv, [alone], None) == Room(101 * POSITION, False, finish=alone, max_positions=100)
    assert planner().room_to_join(kv, BatchShape(1, 10, 0), [alone]).preempt is alone  # a join preempts even it
    nothing: Room[Seq] = planner().room_to_join(KvState(budget_of(100)), BatchShape(1, 200, 300 * POSITION), [])
    assert nothing == Room(300 * POSITION, False)  # the new cache alone: nothing else to give way


def test_a_growing_batch_is_preempted_once_its_rows_outgrow_the_budget() -> None:
    rows = [Seq(10), Seq(10), Seq(10)]
    kv = KvState(budget_of(300))  # 100 positions per row
    preempted_at = []
    for length in range(80, 101):
        room = planner().room_for_step(dataclasses.replace(kv, batch=BatchShape(3, length, 0)), rows, None)
        assert room.max_positions == 100  # new room stops at each row's share of the budget
        if room.preempt is not None:
            preempted_at.append((length, room.preempt))
    assert preempted_at == [(100, rows[-1])]  # only once a step must hold a 101st position per row


def test_held_after_step_counts_the_chunked_prompt_and_the_batchs_new_room() -> None:
    kv = KvState(budget_of(10**6), BatchShape(rows=2, length=100, nbytes=123))
    assert planner().held_after_step(kv, None) == 2 * grown(100, None) * POSITION
    with_chunk = planner().held_after_step(kv, Seq(50))
    assert with_chunk == (50 + MIN_ROOM) * POSITION + 2 * grown(100, None) * POSITION
    room_left = dataclasses.replace(kv, batch=BatchShape(rows=2, length=100, nbytes=123, room_left=True))
    assert planner().held_after_step(room_left, None) == 123
    assert planner().held_after_step(KvState(budget_of(10)), None) == 0


def test_planning_changes_nothing() -> None:
    waiting, running = [Seq(40), Seq(600)], [Seq(10)]
    before = [dataclasses.asdict(s) for s in waiting + running]
    kv = KvState(budget_of(1000, prefix_positions=40), BatchShape(rows=1, length=10, nbytes=0))
    plan = planner().admit(waiting, [32, 512], running, free_slots=4, kv=kv)
    assert plan == Chunk(waiting[0], 32, 40, first=True, last=True)
    planner().room_for_step(kv, running, waiting[1])
    planner().room_to_join(kv, BatchShape(2, 50, 0), running)
    assert [dataclasses.asdict(s) for s in waiting + running] == before  # `cached` is not written into `prefilled`
    assert kv.budget.prefix_bytes == 40 * POSITION
    assert isinstance(plan, Chunk)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.start = 0  # type: ignore[misc]


def test_the_planner_loads_no_torch() -> None:
    code = ("import sys, rayrunner.engines.transformers.step.planner; "
            "print(','.join(m for m in ('torch', 'transformers', 'ray') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == ""
