"""The lifecycle table (`rayrunner.registry.lifecycle`) walked whole, with no model and no Ray: `check_move` allows
exactly the moves of `MOVES`, every phase is reachable from `stopped` and none is a trap, every phase shows a status,
and a registered model driven through each allowed move shows that status in its record, its route and its file."""

from __future__ import annotations

import itertools
from collections import deque
from pathlib import Path

import pytest

from rayrunner.models.spec import ModelSpec
from rayrunner.registry.lifecycle import (
    MOVES,
    OCCUPYING,
    PHASES,
    STATUS,
    LifecycleError,
    Phase,
    check_move,
    unload_mode,
)
from rayrunner.registry.state import ModelRecord, RegistryState

SMOLLM2 = {"type": "plain", "model_id": "smollm2-135m-instruct"}
ALLOWED = sorted((old, new) for old, targets in MOVES.items() for new in targets)
REFUSED = sorted(pair for pair in itertools.product(Phase, Phase) if pair[1] not in MOVES.get(pair[0], ()))


def reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, deque([start])
    while todo:
        for new in MOVES[todo.popleft()] - seen:
            seen.add(new)
            todo.append(new)
    return seen


def path_to(target: Phase) -> list[Phase]:
    """The shortest run of moves from `stopped` to `target` (empty for `stopped` itself)."""
    came_from = {Phase.STOPPED: Phase.STOPPED}
    todo = deque([Phase.STOPPED])
    while todo:
        phase = todo.popleft()
        for new in sorted(MOVES[phase] - came_from.keys()):
            came_from[new] = phase
            todo.append(new)
    path, at = [], target
    while at != Phase.STOPPED:
        path.append(at)
        at = came_from[at]
    return path[::-1]


def registered(model_id: str = "m") -> tuple[RegistryState, ModelRecord]:
    state = RegistryState()
    spec = ModelSpec.model_validate({"model_id": model_id, "which": SMOLLM2})
    return state, state.add(spec, [])


def test_every_phase_has_its_moves_and_its_status() -> None:
    assert set(MOVES) == set(Phase) == set(STATUS)
    assert tuple(phase.value for phase in Phase) == PHASES
    assert set(STATUS.values()) == {"loaded", "unloaded", "reloading"}
    assert {Phase.LOADING, Phase.LOADED} == OCCUPYING  # a load still waiting for room holds none


@pytest.mark.parametrize(("old", "new"), ALLOWED)
def test_check_move_accepts_each_move_of_the_table(old: Phase, new: Phase) -> None:
    check_move("m", old, new)


@pytest.mark.parametrize(("old", "new"), REFUSED)
def test_check_move_refuses_every_other_pair(old: Phase, new: Phase) -> None:
    with pytest.raises(LifecycleError, match=f"`m`: no move from `{old}` to `{new}`"):
        check_move("m", old, new)


def test_the_table_and_its_complement_cover_every_pair() -> None:
    assert len(ALLOWED) + len(REFUSED) == len(Phase) ** 2
    assert all(old != new for old, new in ALLOWED)  # staying put is never a move


def test_every_phase_is_reachable_from_stopped() -> None:
    assert reachable(Phase.STOPPED) == set(Phase)


@pytest.mark.parametrize("phase", list(Phase))
def test_no_phase_is_a_trap(phase: Phase) -> None:
    """From anywhere a model can be loaded again or stopped: no phase keeps it forever."""
    assert reachable(phase) & {Phase.STOPPED, Phase.LOADED}


def test_a_load_ends_loaded_or_failed_and_only_waiting_takes_room() -> None:
    assert MOVES[Phase.LOADING] == {Phase.LOADED, Phase.FAILED}
    assert [old for old, new in ALLOWED if new == Phase.LOADING] == [Phase.WAITING]
    assert {old for old, new in ALLOWED if new == Phase.WAITING} == set(Phase) - {Phase.WAITING, Phase.LOADING}


@pytest.mark.parametrize(("old", "new"), ALLOWED)
def test_a_model_driven_through_each_move_shows_its_status(old: Phase, new: Phase, tmp_path: Path) -> None:
    """From a fresh registration, moves only (never `observe`) to `old`, then `old -> new`: the record, its route
    and the saved file show `new`'s status; an unloaded phase says how it was unloaded, a load keeps it."""
    state, record = registered()
    assert (record.phase, record.status, record.unload_mode) == (Phase.STOPPED, "unloaded", None)
    for step in [*path_to(old), new]:
        before = record.unload_mode
        record.move(step)
        assert (record.phase, record.status) == (step, STATUS[step])
        assert record.unload_mode == (before if STATUS[step] == "reloading" else unload_mode(step))
    assert state.route("m")["status"] == STATUS[new]
    state.save(tmp_path / "registry.json")
    saved = RegistryState.load(tmp_path / "registry.json").models["m"]
    assert (saved.phase, saved.status, saved.unload_mode) == (record.phase, record.status, record.unload_mode)


@pytest.mark.parametrize(("old", "new"), REFUSED)
def test_a_refused_move_leaves_the_model_where_it_was(old: Phase, new: Phase) -> None:
    _, record = registered()
    record.observe(old)
    shown = (record.phase, record.status, record.unload_mode)
    with pytest.raises(LifecycleError):
        record.move(new)
    assert (record.phase, record.status, record.unload_mode) == shown


def test_a_woken_model_remembers_it_slept_until_it_is_loaded() -> None:
    """`unload_mode` through a wake: `sleep` while waiting and loading (the load wakes the replica), none once
    loaded; a model stopped from sleep says `stop`."""
    _, record = registered()
    record.observe(Phase.LOADED)
    seen = []
    for phase in (Phase.ASLEEP, Phase.WAITING, Phase.LOADING, Phase.LOADED, Phase.ASLEEP, Phase.STOPPED):
        record.move(phase)
        seen.append((record.status, record.unload_mode))
    assert seen == [("unloaded", "sleep"), ("reloading", "sleep"), ("reloading", "sleep"), ("loaded", None),
                    ("unloaded", "sleep"), ("unloaded", "stop")]
