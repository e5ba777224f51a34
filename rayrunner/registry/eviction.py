"""The registry's use and capacity book-keeping: in-flight counts from the routers, room made before a load by
evicting idle models (`max_loaded_models`, `max_loaded_bytes`), and the keep_alive timer.

A mixin of `rayrunner.registry.actor.Registry`, kept apart so each file holds one concept; it relies on the registry's
state, config, per-model locks and `_unload`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rayrunner.errors import CapacityError
from rayrunner.models.footprint import estimate_bytes
from rayrunner.models.keep_alive import KeepAlive, idle_deadline
from rayrunner.registry.capacity import IDLE, InFlightBook, Limits, Occupant, plan_room
from rayrunner.registry.config import RegistryConfig
from rayrunner.registry.state import ModelRecord, RegistryState, UnloadMode

logger = logging.getLogger(__name__)
_ROOM_POLL_S = 0.5  # how often a load waiting for room re-checks whether a model became evictable
_IDLE_POLL_S = 0.5  # how often the keep_alive timer looks for models whose time is up


class CapacityMixin:
    state: RegistryState
    config: RegistryConfig
    _in_flight: InFlightBook
    _room: asyncio.Lock
    _loads: dict[str, asyncio.Task[None]]
    _tasks: set[asyncio.Task[None]]

    def _lock(self, model_id: str) -> asyncio.Lock:
        raise NotImplementedError

    async def _unload(self, record: ModelRecord, reason: str, mode: UnloadMode) -> None:
        raise NotImplementedError

    async def report_usage(self, router_id: str, in_flight: dict[str, int],
                           used: dict[str, tuple[float, KeepAlive]]) -> None:
        """A router replica's batch: its open requests per model now, and per model used since its last report the
        last use time and that request's own keep_alive (None: the model's)."""
        self._in_flight.report(router_id, in_flight, time.time())
        for model_id, (at, keep_alive) in used.items():
            record = self.state.models.get(model_id)
            if record is not None:
                record.last_used_at = max(record.last_used_at or 0.0, at)
                record.request_keep_alive = keep_alive

    def _busy(self, model_id: str) -> bool:
        return self._in_flight.count(model_id, time.time()) > 0

    async def _make_room(self, record: ModelRecord) -> None:
        """Before a load: evict idle models until the new one fits; wait (up to the load timeout) while only busy
        or pinned models stand in the way. Raises ModelTooLargeError or CapacityError."""
        limits = Limits(self.config.max_loaded_models, self.config.max_loaded_bytes)
        if limits == Limits():
            return
        deadline = time.monotonic() + self.config.load_timeout_s
        async with self._room:
            new_bytes = await self._footprint(record)
            while True:
                plan = plan_room(limits, await self._occupants(record.spec.model_id), new_bytes)
                if not plan.blocked and not plan.victims:
                    return
                if not plan.blocked:
                    await asyncio.gather(*(self._evict(victim, reason) for victim, reason in plan.victims))
                    continue
                if time.monotonic() > deadline:
                    raise CapacityError(f"no room to load `{record.spec.model_id}`: the other models are pinned, "
                                        f"busy or loading, and none became free within "
                                        f"{self.config.load_timeout_s:.0f} s")
                await asyncio.sleep(_ROOM_POLL_S)

    async def _occupants(self, loading: str) -> list[Occupant]:
        """Every other model that holds memory or is about to (loaded or loading)."""
        occupants = []
        for model_id, record in list(self.state.models.items()):
            if model_id == loading or record.status == "unloaded":
                continue
            evictable = record.status == "loaded" and not self.state.pinned(model_id) and not self._busy(model_id)
            occupants.append(Occupant(model_id, await self._footprint(record), record.last_used_at or 0.0,
                                      record.load_seconds or 0.0, evictable))
        return occupants

    async def _footprint(self, record: ModelRecord) -> int:
        """Estimated bytes (only counted under `max_loaded_bytes`); measured weights once the model has loaded."""
        if self.config.max_loaded_bytes is None:
            return 0
        if record.estimated_bytes is None:
            measured = record.info.get("weight_bytes")
            record.estimated_bytes = await asyncio.to_thread(estimate_bytes, record.spec, measured)
        return record.estimated_bytes

    async def _evict(self, model_id: str, reason: str) -> None:
        """Unload an idle model for `reason`, unless it became busy or unloaded meanwhile, or it is pinned and the
        reason is capacity."""
        if not self._evictable(model_id, reason):
            return  # checked before the lock too: a model that began loading holds its lock while it waits for room
        async with self._lock(model_id):
            if self._evictable(model_id, reason):
                logger.info("unloading `%s` (%s)", model_id, reason)
                mode = self.config.idle_unload_mode if reason == IDLE else "stop"
                await self._unload(self.state.models[model_id], reason, mode)

    def _evictable(self, model_id: str, reason: str) -> bool:
        record = self.state.models.get(model_id)
        # keep_alive applies to pinned models
        pin_holds = record is not None and reason != IDLE and self.state.pinned(model_id)
        return record is not None and record.status == "loaded" and not pin_holds and not self._busy(model_id)

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
            if record.status != "loaded" or model_id in self._loads or self._busy(model_id):
                continue
            since = max(record.last_used_at or 0.0, record.loaded_at or 0.0)
            deadline = idle_deadline(since, record.effective_keep_alive())
            if deadline is not None and now >= deadline:
                expired.append(model_id)
        return expired

    def _spawn(self, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(_logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def _logged(work: Any) -> None:
    try:
        await work
    except Exception:
        logger.exception("background work failed")
