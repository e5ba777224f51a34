"""A model's lifecycle as a state machine: its phases, the one table of moves between them, and the status each
phase shows (`loaded` / `unloaded` / `reloading`, mistral.rs's three).

Every change of a model's phase goes through `ModelRecord.move`, which checks it against `MOVES`; only the
registry's reconciliation with what Serve really runs sets a phase outright (`ModelRecord.observe`). A load waits
for room in `waiting_for_room`, which holds no memory: capacity counts only `loading` and `loaded` models, so loads
queued past the cap never wait on each other.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

Status = Literal["loaded", "unloaded", "reloading"]
UnloadMode = Literal["stop", "sleep"]


class Phase(StrEnum):
    STOPPED = "stopped"  # no replica (never loaded, unloaded by stop, or evicted)
    ASLEEP = "asleep"  # the replica stays with its weights freed; wakes in a fraction of a load
    WAITING = "waiting_for_room"  # a load queued until capacity lets it in; holds nothing
    LOADING = "loading"  # room taken: its replica is starting or waking
    LOADED = "loaded"
    FAILED = "failed"  # the last load failed (`last_error` says why); a request loads it again


MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.STOPPED: frozenset({Phase.WAITING}),
    Phase.FAILED: frozenset({Phase.WAITING}),
    Phase.ASLEEP: frozenset({Phase.WAITING, Phase.STOPPED}),
    # out of the queue: room given, or none in time (back to where it was: asleep if its replica still sleeps)
    Phase.WAITING: frozenset({Phase.LOADING, Phase.STOPPED, Phase.ASLEEP, Phase.FAILED}),
    Phase.LOADING: frozenset({Phase.LOADED, Phase.FAILED}),
    # unloaded (stop or sleep), or redeployed over its running app (a config changed its spec)
    Phase.LOADED: frozenset({Phase.STOPPED, Phase.ASLEEP, Phase.WAITING}),
}

STATUS: dict[Phase, Status] = {
    Phase.STOPPED: "unloaded",
    Phase.ASLEEP: "unloaded",
    Phase.FAILED: "unloaded",
    Phase.WAITING: "reloading",
    Phase.LOADING: "reloading",
    Phase.LOADED: "loaded",
}

PHASES: tuple[str, ...] = tuple(phase.value for phase in Phase)
# What capacity counts as holding memory (or about to): never a load that still waits for room.
OCCUPYING = frozenset({Phase.LOADING, Phase.LOADED})


class LifecycleError(RuntimeError):
    """A move the table does not allow: a bug in the registry, never a user's mistake."""


def check_move(model_id: str, old: Phase, new: Phase) -> None:
    if new not in MOVES[old]:
        raise LifecycleError(f"model `{model_id}`: no move from `{old}` to `{new}`")


_UNLOAD_MODES: dict[Phase, UnloadMode] = {Phase.ASLEEP: "sleep", Phase.STOPPED: "stop"}


def unload_mode(phase: Phase) -> UnloadMode | None:
    """How an unloaded model was unloaded (the card's `unload_mode`)."""
    return _UNLOAD_MODES.get(phase)


def phase_of(status: Status, mode: UnloadMode | None) -> Phase:
    """The phase a state file written before phases existed describes."""
    if status == "loaded":
        return Phase.LOADED
    if status == "reloading":
        return Phase.LOADING
    return Phase.ASLEEP if mode == "sleep" else Phase.STOPPED
