"""Capacity rules, pure and without Ray: which idle models to evict to make room.

The registry actor applies them: before a load it asks `plan_room` which loaded models to unload: the one whose
eviction is expected to cost least first, by how often it is wanted (its recent uses, decayed with
`USE_HALF_LIFE_S`, so of two used as often the one used longer ago goes) times what bringing it back costs (a wake,
or its cold load's seconds when eviction stops models); the least recently used first on a tie. `keep_alive`
durations are `rayrunner.models.keep_alive`. A model whose size is unknown (`rayrunner.models.footprint`: weights
not on the registry's machine, a GPU's default KV budget before a replica reported it) counts as `unknown_bytes`
says until its replica reports what it holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayrunner.errors import ModelTooLargeError

IDLE = "idle"
USE_HALF_LIFE_S = 120.0  # a request's weight in a model's recent uses halves every this many seconds
EVICTED_MODELS = "evicted: max_loaded_models"
EVICTED_BYTES = "evicted: max_loaded_bytes"
EVICTED_ASLEEP = "evicted: max_asleep_models"
EVICTED_RESOURCES = "evicted: resources"  # a sleeping replica stopped for the CPUs/GPUs a new one needs


@dataclass(frozen=True)
class Occupant:
    """A model that holds (or is about to hold) memory, as the capacity plan sees it."""

    model_id: str
    bytes: int | None = 0  # None: unknown (`unknown_bytes`)
    last_used: float = 0.0
    load_seconds: float = 0.0
    evictable: bool = True  # loaded, not pinned, no request in flight
    uses: float = 0.0  # recent requests, decayed (`decayed_uses`)
    reload_cost: float = 1.0  # what bringing it back from where eviction sends it costs (`reload_cost`)

    def eviction_cost(self) -> float:
        """Expected cost of evicting it: how often it is wanted times what bringing it back costs."""
        return self.uses * self.reload_cost


def reload_cost(load_seconds: float | None, evicted_to_sleep: bool) -> float:
    """A wake costs about the same for every model (1); a stopped model's cold load costs its last load's seconds,
    rounded to a power of two so that noise in a measurement does not reorder models of one kind."""
    if evicted_to_sleep or not load_seconds:
        return 1.0
    return float(2 ** round(math.log2(max(load_seconds, 0.5))))


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


def plan_room(limits: Limits, occupants: list[Occupant], new_bytes: int | None) -> RoomPlan:
    """What to evict so one more model (of `new_bytes`; None: unknown) fits: least recently used first, then the
    cheaper reload. Raises ModelTooLargeError when the model cannot fit even alone."""
    if limits.max_bytes is not None and new_bytes is not None and new_bytes > limits.max_bytes:
        raise ModelTooLargeError(
            f"the model needs about {new_bytes} bytes, more than max_loaded_bytes ({limits.max_bytes}) allows "
            "even with every other model unloaded", param="model")
    stand_in = unknown_bytes(limits, [new_bytes, *(o.bytes for o in occupants)])
    sizes = {o.model_id: stand_in if o.bytes is None else o.bytes for o in occupants}
    new_bytes = stand_in if new_bytes is None else new_bytes
    count, total = len(occupants), sum(sizes.values())
    victims: list[tuple[str, str]] = []
    candidates = sorted((o for o in occupants if o.evictable),
                        key=lambda o: (o.eviction_cost(), o.last_used, o.load_seconds))
    for candidate in candidates:
        reason = _over(limits, count, total, new_bytes)
        if reason is None:
            break
        victims.append((candidate.model_id, reason))
        count, total = count - 1, total - sizes[candidate.model_id]
    return RoomPlan(victims, blocked=_over(limits, count, total, new_bytes) is not None)


def unknown_bytes(limits: Limits, sizes: list[int | None]) -> int:
    """What a model of unknown size counts as: the largest size known among `sizes` (the model to load and those
    holding room), within max_loaded_bytes; all of max_loaded_bytes when none is known, so that it loads alone."""
    known = [size for size in sizes if size is not None]
    ceiling = limits.max_bytes or 0
    return min(max(known), ceiling) if known else ceiling


def _over(limits: Limits, count: int, total: int, new_bytes: int) -> str | None:
    """The limit one more model would break, if any."""
    if limits.max_models is not None and count + 1 > limits.max_models:
        return EVICTED_MODELS
    if limits.max_bytes is not None and total + new_bytes > limits.max_bytes:
        return EVICTED_BYTES
    return None


def decayed_uses(uses: float, since: float, now: float, new: int = 0) -> float:
    """A model's recent uses at `now`, from `uses` counted at `since`, plus `new` requests now."""
    return uses * 0.5 ** (max(0.0, now - since) / USE_HALF_LIFE_S) + new


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
