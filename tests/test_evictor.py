"""The registry's `Evictor` on its own, no Registry and no Ray: built over a `RegistryState` with a fake `ModelApps`
and an `unload` callback that records each call, it evicts the idle model cheapest to evict, never a busy, just
claimed, pinned or loading one, gives waiting loads room most-requested first (oldest first past the fairness bound),
fails a load that finds no room in time alone, keeps sleepers within `max_asleep_models`, and its keep_alive timer
unloads idle models (pinned ones too) with `idle_unload_mode`."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import pytest

from rayrunner.errors import CapacityError
from rayrunner.models.spec import ModelSpec
from rayrunner.registry.config import RegistryConfig
from rayrunner.registry.eviction_rules import EVICTED_ASLEEP, EVICTED_BYTES, EVICTED_MODELS, IDLE
from rayrunner.registry.evictor import Evictor
from rayrunner.registry.lifecycle import Phase
from rayrunner.registry.state import ModelRecord, RegistryState, UnloadMode
from tests.fake_model_apps import FakeModelApps

SMOLLM2 = {"type": "plain", "model_id": "smollm2-135m-instruct"}
WAIT_S = 5.0  # far past what any step here takes


class Host:
    """What the registry gives its evictor: the state, per-model locks, the loads under way, background tasks, and
    an unload that records `(model, reason, mode)` and moves the model as the registry's does."""

    def __init__(self, models: str, **config: Any) -> None:
        self.state = RegistryState()
        for model_id in models:
            self.state.add(ModelSpec.model_validate({"model_id": model_id, "which": SMOLLM2}), [])
        self.locks: dict[str, asyncio.Lock] = {}
        self.loading: set[str] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.unloads: list[tuple[str, str, UnloadMode]] = []
        self.evictor = Evictor(self.state, RegistryConfig.model_validate(config), FakeModelApps(),
                               lock=self.lock, unload=self.unload, loading=self.loading, spawn=self.spawn)

    def lock(self, model_id: str) -> asyncio.Lock:
        return self.locks.setdefault(model_id, asyncio.Lock())

    async def unload(self, record: ModelRecord, reason: str, mode: UnloadMode) -> None:
        assert self.locks[record.spec.model_id].locked()  # the evictor holds the model's lock, as the registry must
        self.unloads.append((record.spec.model_id, reason, mode))
        record.move(Phase.ASLEEP if mode == "sleep" else Phase.STOPPED)

    def spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def record(self, model_id: str) -> ModelRecord:
        return self.state.models[model_id]

    def loaded(self, model_id: str, last_used: float = 0.0, uses: float = 0.0) -> None:
        """`model_id` loaded, last used at `last_used` (seconds ago), `uses` recent requests."""
        record = self.record(model_id)
        for phase in (Phase.WAITING, Phase.LOADING, Phase.LOADED):
            record.move(phase)
        record.last_used_at = record.loaded_at = time.time() - last_used
        record.recent_uses, record.recent_uses_at = uses, time.time()

    async def make_room(self, model_id: str) -> None:
        self.record(model_id).move(Phase.WAITING)
        await asyncio.wait_for(self.evictor.make_room(self.record(model_id)), WAIT_S)

    def phases(self) -> dict[str, Phase]:
        return {model_id: record.phase for model_id, record in self.state.models.items()}


async def test_the_idle_model_cheapest_to_evict_goes() -> None:
    """Room for two: `a` wanted ten times long ago stays, `b` used once just now goes; the loading model moves to
    `loading` once room is made, and the victim is unloaded with `evict_mode`."""
    host = Host("abc", max_loaded_models=2)
    host.loaded("a", last_used=100, uses=10)
    host.loaded("b", last_used=1, uses=1)
    await host.make_room("c")
    assert host.unloads == [("b", EVICTED_MODELS, "sleep")]
    assert host.phases() == {"a": Phase.LOADED, "b": Phase.ASLEEP, "c": Phase.LOADING}


async def test_of_two_wanted_alike_the_least_recently_used_goes() -> None:
    host = Host("abc", max_loaded_models=2, evict_mode="stop")
    host.loaded("a", last_used=5)
    host.loaded("b", last_used=50)
    await host.make_room("c")
    assert host.unloads == [("b", EVICTED_MODELS, "stop")] and host.record("b").phase == Phase.STOPPED


async def test_busy_claimed_pinned_and_loading_models_are_never_evicted() -> None:
    """Room for five, held by a model with a request in flight, one just loaded for a request (claimed), a pinned
    one and one still loading, each used longer ago and less than the idle one: the idle one goes."""
    host = Host("bcpLin", max_loaded_models=5)
    for model_id in "bcp":
        host.loaded(model_id, last_used=100)
    host.record("L").move(Phase.WAITING)
    host.record("L").move(Phase.LOADING)
    host.loaded("i", last_used=1, uses=50)
    host.evictor.report_usage("router", {"b": 1}, {})
    host.evictor.claim("c")
    host.record("p").pinned = True
    await host.make_room("n")
    assert host.unloads == [("i", EVICTED_MODELS, "sleep")]
    assert host.phases() == {"b": Phase.LOADED, "c": Phase.LOADED, "p": Phase.LOADED, "L": Phase.LOADING,
                             "i": Phase.ASLEEP, "n": Phase.LOADING}


async def test_a_load_with_only_kept_models_in_the_way_fails_alone_and_goes_back() -> None:
    """Room for one, held by a pinned model: the load waits `load_timeout_s`, evicts nothing, fails with a 503 and
    goes back to where it was (asleep, as its replica sleeps)."""
    host = Host("pa", max_loaded_models=1, load_timeout_s=0.3)
    host.loaded("p")
    host.record("p").pinned = True
    host.loaded("a")
    host.record("a").move(Phase.ASLEEP)
    started = time.monotonic()
    with pytest.raises(CapacityError) as raised:
        await host.make_room("a")
    assert time.monotonic() - started >= 0.3 and raised.value.status == 503
    assert host.unloads == [] and host.phases() == {"p": Phase.LOADED, "a": Phase.ASLEEP}
    assert not host.evictor.waits_for_room("a")


async def test_bytes_evict_until_the_new_model_fits() -> None:
    host = Host("abcn", max_loaded_bytes=1000)
    for model_id, size, last_used in (("a", 400, 30), ("b", 300, 20), ("c", 200, 10)):
        host.loaded(model_id, last_used=last_used)
        host.record(model_id).estimated_bytes = size
    host.record("n").estimated_bytes = 500
    await host.make_room("n")
    assert host.unloads == [("a", EVICTED_BYTES, "sleep")]  # without `a`: 300 + 200 + 500 fits in 1000
    assert host.record("n").phase == Phase.LOADING


async def until(done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, "never happened"
        await asyncio.sleep(0.001)


async def _queued_behind_a_busy_model(host: Host, stack: contextlib.ExitStack) -> dict[str, asyncio.Task[None]]:
    """Room for one, held by `a` with a request in flight; a load of `b` (one request) waits, then one of `c`
    (three requests)."""
    host.loaded("a")
    host.evictor.report_usage("router", {"a": 1}, {})
    loads = {}
    for model_id, requests in (("b", 1), ("c", 3)):
        for _ in range(requests):
            stack.enter_context(host.evictor.queue(model_id))
        loads[model_id] = asyncio.create_task(host.make_room(model_id))
        await until(functools.partial(host.evictor.waits_for_room, model_id))
    assert (host.evictor.queued("b"), host.evictor.queued("c")) == (1, 3)
    return loads


async def _room_order(host: Host) -> list[str]:
    """Which of `b` and `c` gets room first, then second, once `a`'s request ends (each load moves to `loaded` as
    soon as it has room, and is idle: the other may evict it)."""
    order = []
    with contextlib.ExitStack() as stack:
        loads = await _queued_behind_a_busy_model(host, stack)
        host.evictor.report_usage("router", {}, {})  # a's request ended: room for one
        for done in asyncio.as_completed(loads.values(), timeout=WAIT_S):
            await done
            order += [mid for mid in loads if loads[mid].done() and mid not in order]
            for model_id in order:
                if host.record(model_id).phase == Phase.LOADING:
                    host.record(model_id).move(Phase.LOADED)
            host.evictor.changed()
    return order


async def test_waiting_loads_get_room_most_requested_first() -> None:
    host = Host("abc", max_loaded_models=1)
    assert await _room_order(host) == ["c", "b"]
    assert [model for model, _, _ in host.unloads] == ["a", "c"]


async def test_a_load_waiting_past_the_fairness_bound_goes_first_oldest_first() -> None:
    host = Host("abc", max_loaded_models=1, room_fairness_s=0)
    assert await _room_order(host) == ["b", "c"]


async def test_queued_requests_past_the_bound_are_refused() -> None:
    host = Host("a", max_queued_requests=2)
    with host.evictor.queue("a"), host.evictor.queue("a"):
        with pytest.raises(CapacityError, match="max_queued_requests"), host.evictor.queue("a"):
            pass
        assert host.evictor.queued("a") == 2
    assert host.evictor.queued("a") == 0


async def test_sleepers_past_max_asleep_models_are_stopped_least_recently_used_first() -> None:
    host = Host("abc", max_loaded_models=1, max_asleep_models=1)
    host.loaded("a", last_used=20)
    await host.make_room("b")
    host.record("b").move(Phase.LOADED)
    host.record("b").last_used_at = time.time()
    await host.make_room("c")
    assert host.unloads == [("a", EVICTED_MODELS, "sleep"), ("b", EVICTED_MODELS, "sleep"),
                            ("a", EVICTED_ASLEEP, "stop")]
    assert host.phases() == {"a": Phase.STOPPED, "b": Phase.ASLEEP, "c": Phase.LOADING}


async def test_the_keep_alive_timer_unloads_idle_models_and_spares_busy_and_loading_ones() -> None:
    host = Host("pbl", idle_unload_mode="sleep")
    for model_id in "pbl":
        host.loaded(model_id, last_used=10)
        host.record(model_id).keep_alive = "1s"
    host.record("p").pinned = True  # keep_alive applies to pinned models
    host.evictor.report_usage("router", {"b": 1}, {})
    host.loading.add("l")  # its load is still finishing
    assert host.evictor.start() and not host.evictor.start()  # one timer
    await until(lambda: bool(host.unloads))
    await asyncio.gather(*host.tasks)
    assert host.unloads == [("p", IDLE, "sleep")]
    assert host.phases() == {"p": Phase.ASLEEP, "b": Phase.LOADED, "l": Phase.LOADED}
