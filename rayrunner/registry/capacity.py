"""Capacity rules, pure and without Ray: which idle models to evict to make room.

The registry actor applies them: before a load it asks `plan_room` which loaded models to unload (least recently
used first, the cheaper reload first on a tie); `keep_alive` durations are `rayrunner.models.keep_alive`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayrunner.errors import ModelTooLargeError

IDLE = "idle"
EVICTED_MODELS = "evicted: max_loaded_models"
EVICTED_BYTES = "evicted: max_loaded_bytes"
EVICTED_ASLEEP = "evicted: max_asleep_models"


@dataclass(frozen=True)
class Occupant:
    """A model that holds (or is about to hold) memory, as the capacity plan sees it."""

    model_id: str
    bytes: int = 0
    last_used: float = 0.0
    load_seconds: float = 0.0
    evictable: bool = True  # loaded, not pinned, no request in flight


@dataclass(frozen=True)
class Limits:
    max_models: int | None = None
    max_bytes: int | None = None


@dataclass(frozen=True)
class RoomPlan:
    """Models to unload (with the limit that forces each), or `blocked` when the busy and pinned ones leave no
    room now."""

    victims: list[tuple[str, str]]
    blocked: bool = False


def plan_room(limits: Limits, occupants: list[Occupant], new_bytes: int) -> RoomPlan:
    """What to evict so one more model (of `new_bytes`) fits: least recently used first, then the cheaper reload.
    Raises ModelTooLargeError when the model cannot fit even alone."""
    if limits.max_bytes is not None and new_bytes > limits.max_bytes:
        raise ModelTooLargeError(
            f"the model needs about {new_bytes} bytes, more than max_loaded_bytes ({limits.max_bytes}) allows "
            "even with every other model unloaded", param="model")
    count, total = len(occupants), sum(o.bytes for o in occupants)
    victims: list[tuple[str, str]] = []
    candidates = sorted((o for o in occupants if o.evictable), key=lambda o: (o.last_used, o.load_seconds))
    for candidate in candidates:
        reason = _over(limits, count, total, new_bytes)
        if reason is None:
            break
        victims.append((candidate.model_id, reason))
        count, total = count - 1, total - candidate.bytes
    return RoomPlan(victims, blocked=_over(limits, count, total, new_bytes) is not None)


def _over(limits: Limits, count: int, total: int, new_bytes: int) -> str | None:
    """The limit one more model would break, if any."""
    if limits.max_models is not None and count + 1 > limits.max_models:
        return EVICTED_MODELS
    if limits.max_bytes is not None and total + new_bytes > limits.max_bytes:
        return EVICTED_BYTES
    return None


IN_FLIGHT_TTL_S = 10.0  # a router's in-flight report counts this long unless refreshed (routers re-send while busy)


class InFlightBook:
    """Requests in flight per model, as each router replica last reported them (a report replaces the router's
    previous one). A router that stops reporting (it died) stops counting after `IN_FLIGHT_TTL_S`."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, int]]] = {}

    def report(self, router_id: str, in_flight: dict[str, int], now: float) -> None:
        self._reports[router_id] = (now, {model: n for model, n in in_flight.items() if n > 0})

    def count(self, model_id: str, now: float) -> int:
        return sum(counts.get(model_id, 0) for at, counts in self._reports.values() if now - at <= IN_FLIGHT_TTL_S)
