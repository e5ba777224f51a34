"""The registry's use and capacity book-keeping: in-flight counts from the routers, room made before a load by
evicting idle models (`max_loaded_models`, `max_loaded_bytes`), and the keep_alive timer.

A load waiting for room holds none (`lifecycle.Phase.WAITING`): room is counted over loading and loaded models
only, so loads queued past the cap never wait on one another. Waiting loads take room one at a time (the room lock
is never held while a load waits), the one with the most requests queued for it first, so the fewest swaps serve
the queued requests; one that has waited `room_fairness_s` goes before any that has not, oldest first. A load that
gets no room within `load_timeout_s` fails alone with a 503. A model just loaded for a request is protected from
eviction until the router's next usage report counts that request (`claim`).

`Evictor` is an object the registry (`rayrunner.registry.actor.Registry`) owns, built with what it works on passed in:
the state, the config, the model apps, the per-model lock lookup, the loads under way, how to unload a model
(`Unload`) and how to run background work. It holds no Ray, so tests drive it against a fake `ModelApps`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Container, Coroutine, Iterator
from typing import Any

from rayrunner.errors import CapacityError
from rayrunner.models.footprint import estimate_bytes, replica_measures
from rayrunner.models.keep_alive import KeepAlive, idle_deadline
from rayrunner.registry.config import RegistryConfig
from rayrunner.registry.eviction_rules import (
    EVICTED_ASLEEP,
    EVICTED_RESOURCES,
    IDLE,
    InFlightBook,
    Limits,
    Occupant,
    decayed_uses,
    plan_room,
    reload_cost,
)
from rayrunner.registry.lifecycle import OCCUPYING, Phase
from rayrunner.registry.model_apps import ModelApps
from rayrunner.registry.state import ModelRecord, RegistryState, UnloadMode

logger = logging.getLogger(__name__)
_ROOM_POLL_S = 0.5  # longest a load waiting for room goes without re-checking (a change wakes it sooner)
_IDLE_POLL_S = 0.5  # how often the keep_alive timer looks for models whose time is up
_RESOURCES_SETTLE_S = 3.0  # how long freed resources may take to show as free before another sleeper is stopped
CLAIM_S = 2.0  # a model loaded for a request stays protected this long, unless a usage report counts it first


Unload = Callable[[ModelRecord, str, UnloadMode], Awaitable[None]]  # (record, reason, mode); caller holds the lock
Spawn = Callable[[Coroutine[Any, Any, None]], None]  # runs work in the background, logging its failure


class Evictor:
    """Room for loads, eviction and the keep_alive timer, over the registry's state (see the module docstring)."""

    def __init__(self, state: RegistryState, config: RegistryConfig, apps: ModelApps, *,
                 lock: Callable[[str], asyncio.Lock], unload: Unload, loading: Container[str], spawn: Spawn) -> None:
        self.state, self.config, self.apps = state, config, apps  # the registry replaces `config` on bootstrap
        self._lock, self._unload, self._loading, self._spawn = lock, unload, loading, spawn
        self._in_flight = InFlightBook()
        self._room = asyncio.Lock()  # one load at a time makes room, so two never count the same free slot
        self._claims: dict[str, float] = {}  # models just loaded for a request (see `claim`)
        self._room_changed = asyncio.Event()  # set (and replaced) whenever room may have come free
        self._room_requests: dict[str, float] = {}  # loads waiting for room, and since when (monotonic)
        self._queued: dict[str, int] = {}  # requests waiting for each model's load
        self._timer: asyncio.Task[None] | None = None

    def start(self) -> bool:
        """Start the keep_alive timer (in the running loop); False when it runs already."""
        if self._timer is not None:
            return False
        self._timer = asyncio.get_running_loop().create_task(self._watch_idle())
        return True

    def report_usage(self, router_id: str, in_flight: dict[str, int],
                     used: dict[str, tuple[float, KeepAlive] | tuple[float, KeepAlive, int]]) -> None:
        """A router replica's batch: its open requests per model now, and per model used since its last report the
        last use time, that request's own keep_alive (None: the model's) and how many requests began (one if not
        said)."""
        now = time.time()
        self._in_flight.report(router_id, in_flight, now)
        for model_id in in_flight:  # counted now: the in-flight book protects it
            self._claims.pop(model_id, None)
        for model_id, (at, keep_alive, *begun) in used.items():
            if at >= self._claims.get(model_id, float("inf")):  # the router has seen its request since
                self._claims.pop(model_id, None)
            record = self.state.models.get(model_id)
            if record is not None:
                record.last_used_at = max(record.last_used_at or 0.0, at)
                record.request_keep_alive = keep_alive
                record.recent_uses = decayed_uses(record.recent_uses, record.recent_uses_at or now, now,
                                                  begun[0] if begun else 1)
                record.recent_uses_at = now
        self.changed()

    def in_flight(self, model_id: str) -> int:
        """Requests open for `model_id` now, as the routers last reported them."""
        return self._in_flight.count(model_id, time.time())

    @contextlib.contextmanager
    def queue(self, model_id: str) -> Iterator[None]:
        """Count one request waiting for `model_id`'s load while it waits (the most queued load gets room first);
        raises CapacityError past `max_queued_requests`."""
        queued = self._queued.get(model_id, 0)
        if queued >= self.config.max_queued_requests:
            raise CapacityError(f"{queued} requests already wait for `{model_id}` to load "
                                f"(max_queued_requests); retry later")
        self._queued[model_id] = queued + 1
        try:
            yield
        finally:
            self._queued[model_id] -= 1

    def queued(self, model_id: str) -> int:
        return self._queued.get(model_id, 0)

    def waits_for_room(self, model_id: str) -> bool:
        return model_id in self._room_requests

    def claim(self, model_id: str) -> None:
        """`model_id` was just made ready for a request the routers may not have reported yet."""
        self._claims[model_id] = time.time()

    def _busy(self, model_id: str) -> bool:
        now = time.time()
        if now - self._claims.get(model_id, -CLAIM_S) < CLAIM_S:
            return True
        return self._in_flight.count(model_id, now) > 0

    def changed(self) -> None:
        """Wake the loads waiting for room: a model changed phase, or became idle."""
        self._room_changed.set()
        self._room_changed = asyncio.Event()

    async def make_room(self, record: ModelRecord) -> None:
        """Before a load (the model is `waiting_for_room`): evict idle models until it fits, then move it to
        `loading`; wait (up to the load timeout) while only busy, pinned or loading models stand in the way. When
        there is no room (too large, or none in time) the model goes back to where it was (asleep if its replica
        sleeps, else stopped) and ModelTooLargeError or CapacityError is raised (a 400 or a 503, not a load
        failure)."""
        try:
            await self._wait_for_room(record)
        except Exception:
            record.move(Phase.ASLEEP if record.unload_mode == "sleep" else Phase.STOPPED)
            raise

    async def _wait_for_room(self, record: ModelRecord) -> None:
        """`make_room` until it raises: the model waits its turn (`_next_for_room`), then takes room or waits on."""
        limits = Limits(self.config.max_loaded_models, self.config.max_loaded_bytes)
        if limits == Limits():
            record.move(Phase.LOADING)
            return
        model_id = record.spec.model_id
        deadline = time.monotonic() + self.config.load_timeout_s
        new_bytes = await self.footprint(record)
        self._room_requests[model_id] = time.monotonic()
        try:
            while True:
                changed = self._room_changed
                if self._next_for_room() == model_id:
                    async with self._room:
                        if await self._take_room(record, limits, new_bytes):
                            return
                if time.monotonic() > deadline:
                    raise CapacityError(f"no room to load `{model_id}`: the other models are pinned, busy or "
                                        f"loading, and none became free within {self.config.load_timeout_s:.0f} s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), _ROOM_POLL_S)
        finally:
            del self._room_requests[model_id]
            self.changed()  # the next in line may try now

    def _next_for_room(self) -> str:
        """The waiting load that may take room next: the longest waiting of those past `room_fairness_s`, else the
        one with the most requests queued (the oldest on a tie)."""
        now, fairness = time.monotonic(), self.config.room_fairness_s
        overdue = [(since, mid) for mid, since in self._room_requests.items() if now - since >= fairness]
        if overdue:
            return min(overdue)[1]
        return min(self._room_requests, key=lambda mid: (-self._queued.get(mid, 0), self._room_requests[mid]))

    async def _take_room(self, record: ModelRecord, limits: Limits, new_bytes: int | None) -> bool:
        """Under the room lock: evict what the plan names, and take the room (move to `loading`) if it is there
        now. The plan and the move have no `await` between them, so no other load counts the same room."""
        plan = plan_room(limits, await self._occupants(record.spec.model_id), new_bytes)
        if not plan.blocked and plan.victims:
            await asyncio.gather(*(self._evict(victim, reason) for victim, reason in plan.victims))
            plan = plan_room(limits, await self._occupants(record.spec.model_id), new_bytes)
        if plan.blocked or plan.victims:
            return False
        record.move(Phase.LOADING)
        return True

    async def _occupants(self, loading: str) -> list[Occupant]:
        """Every other model that holds memory or is about to (loaded, or loading with its room taken)."""
        occupants = []
        for model_id, record in list(self.state.models.items()):
            if model_id == loading or record.phase not in OCCUPYING:
                continue
            evictable = record.phase == Phase.LOADED and not self.state.pinned(model_id) and not self._busy(model_id)
            uses = decayed_uses(record.recent_uses, record.recent_uses_at or 0.0, time.time())
            occupants.append(Occupant(model_id, await self.footprint(record), record.last_used_at or 0.0,
                                      record.load_seconds or 0.0, evictable, uses,
                                      reload_cost(record.load_seconds, self.config.evict_mode == "sleep")))
        return occupants

    async def footprint(self, record: ModelRecord) -> int | None:
        """Estimated bytes (only counted under `max_loaded_bytes`; None: unknown, estimated again next time);
        measured weights and KV budget once the model has loaded."""
        if self.config.max_loaded_bytes is None:
            return 0
        if record.estimated_bytes is None:
            measured = replica_measures(record.info)
            record.estimated_bytes = await asyncio.to_thread(estimate_bytes, record.spec, *measured)
        return record.estimated_bytes

    async def _evict(self, model_id: str, reason: str) -> None:
        """Unload an idle model for `reason`, unless it became busy or unloaded meanwhile, or it is pinned and the
        reason is capacity."""
        if not self._evictable(model_id, reason):
            return  # checked before the lock too: a model that began loading holds its lock while it waits for room
        mode = self.config.idle_unload_mode if reason == IDLE else self.config.evict_mode
        async with self._lock(model_id):
            if not self._evictable(model_id, reason):
                return
            logger.info("unloading `%s` (%s, %s)", model_id, reason, mode)
            await self._unload(self.state.models[model_id], reason, mode)
        if mode == "sleep":
            await self._keep_asleep_within_limit()

    async def stop_sleepers_for(self, record: ModelRecord) -> None:
        """Before a new replica starts: stop the least recently used sleeping models while their replicas hold the
        resources (CPUs, GPUs) it needs; without any asleep, Serve queues the replica and the load's time bounds it."""
        while not await self.apps.fits_now(record.spec):
            asleep = [r for r in self.state.models.values() if r.phase == Phase.ASLEEP and r is not record]
            if not asleep:
                return
            oldest = min(asleep, key=lambda r: r.last_used_at or 0.0)
            await self._stop_asleep(oldest, EVICTED_RESOURCES, f"its replica holds what `{record.spec.model_id}` needs")
            await self._until_fits(record, _RESOURCES_SETTLE_S)  # the cluster's count of free resources lags

    async def _until_fits(self, record: ModelRecord, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.apps.fits_now(record.spec) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def _keep_asleep_within_limit(self) -> None:
        """Stop the least recently used sleeping models past `max_asleep_models` (their replicas exit)."""
        limit = self.config.max_asleep_models
        asleep = sorted((r for r in self.state.models.values() if r.phase == Phase.ASLEEP),
                        key=lambda r: r.last_used_at or 0.0)
        for record in asleep[:max(0, len(asleep) - limit)] if limit is not None else []:
            await self._stop_asleep(record, EVICTED_ASLEEP, "max_asleep_models")

    async def _stop_asleep(self, record: ModelRecord, reason: str, why: str) -> None:
        """Stop a sleeping model (its replica exits), unless it woke or was removed while this waited for its lock."""
        async with self._lock(record.spec.model_id):
            if record.phase == Phase.ASLEEP and self.state.models.get(record.spec.model_id) is record:
                logger.info("stopping `%s` (asleep: %s)", record.spec.model_id, why)
                await self._unload(record, reason, "stop")

    def _evictable(self, model_id: str, reason: str) -> bool:
        record = self.state.models.get(model_id)
        # keep_alive applies to pinned models
        pin_holds = record is not None and reason != IDLE and self.state.pinned(model_id)
        return record is not None and record.phase == Phase.LOADED and not pin_holds and not self._busy(model_id)

    async def _watch_idle(self) -> None:
        """The keep_alive timer: unload each loaded, idle model whose keep_alive ran out since its last use."""
        while True:
            try:
                for model_id in self._expired(time.time()):
                    self._spawn(self._evict(model_id, IDLE))
            except Exception:
                logger.exception("keep_alive check failed")
            await asyncio.sleep(_IDLE_POLL_S)

    def _expired(self, now: float) -> list[str]:
        expired = []
        for model_id, record in self.state.models.items():
            if record.phase != Phase.LOADED or model_id in self._loading or self._busy(model_id):
                continue
            since = max(record.last_used_at or 0.0, record.loaded_at or 0.0)
            deadline = idle_deadline(since, record.effective_keep_alive())
            if deadline is not None and now >= deadline:
                expired.append(model_id)
        return expired
