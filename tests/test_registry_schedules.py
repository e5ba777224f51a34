"""The registry's capacity logic under random interleavings, in process against `FakeModelApps`: many concurrent
requests (loads), unloads, pins, removes and re-adds for more models than `max_loaded_models` allows. Every
schedule must make progress: each call ends (served or failed with its own error) within its time, never more
models hold memory than the cap, and when the calls are done no model is left `reloading`."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from rayrunner.errors import CapacityError, RayRunnerError
from rayrunner.registry.actor import Registry
from rayrunner.registry.lifecycle import OCCUPYING, Phase
from tests.fake_model_apps import FakeModelApps

SMOLLM2 = {"type": "plain", "model_id": "smollm2-135m-instruct"}
SCHEDULES = 1000
# With pins a load may rightly find no room: it fails after a short wait. Without them requests last milliseconds,
# so a load that waits out a long timeout waited on loads queued beside it (the deadlock this test is for).
PINNED_LOAD_TIMEOUT_S, LOAD_TIMEOUT_S = 0.1, 5.0
HANG_S = 60.0  # far past any wait a call may have: a call still running then hangs


def entry(model_id: str) -> dict[str, Any]:
    return {"spec": {"model_id": model_id, "which": SMOLLM2}, "load": False}


class Schedule:
    """One random schedule: its registry, a router's usage reports, and what the invariants saw."""

    def __init__(self, rng: random.Random, registry: Registry, apps: FakeModelApps, cap: int) -> None:
        self.rng, self.registry, self.apps, self.cap = rng, registry, apps, cap
        self.open: collections.Counter[str] = collections.Counter()
        self.most_occupying = self.most_running = 0
        self.served = 0
        self.pins = False

    async def report(self, model_id: str) -> None:
        self.open = +self.open
        await self.registry.report_usage("router", dict(self.open), {model_id: (time.time(), None)})

    async def request(self, model_id: str) -> None:
        """A router's request: counted open, the model made ready, a short generation, closed."""
        self.open[model_id] += 1
        await self.report(model_id)
        try:
            await self.registry.ensure_loaded(model_id)
            self.served += 1
            await asyncio.sleep(self.rng.choice([0, 0, 0.001, 0.005]))
        finally:
            self.open[model_id] -= 1
            await self.report(model_id)

    async def unload(self, model_id: str) -> None:
        await self.registry.unload(model_id, self.rng.choice(["stop", "sleep"]))

    async def pin(self, model_id: str) -> None:
        await self.registry.set_pinned(model_id, self.rng.random() < 0.5)

    async def remove_and_add(self, model_id: str) -> None:
        await self.registry.remove(model_id)
        await asyncio.sleep(0)
        await self.registry.add(entry(model_id))

    async def watch(self) -> None:
        """Check the cap after every turn of the loop: in the registry's phases and in the apps that really run."""
        while True:
            records = self.registry.state.models.values()
            self.most_occupying = max(self.most_occupying, sum(r.phase in OCCUPYING for r in records))
            running = sum(app.running and not app.asleep for app in self.apps.apps.values())
            self.most_running = max(self.most_running, running)
            await asyncio.sleep(0)


async def _call(work: Any) -> str:
    """Run one call to its end: `ok`, or the name of the rayrunner error it failed with. Anything much slower than
    its time is a hang, and fails the schedule."""
    try:
        await asyncio.wait_for(work, HANG_S)
    except RayRunnerError as exc:
        return type(exc).__name__
    return "ok"


async def run_schedule(seed: int, tmp_path: Path) -> tuple[Schedule, list[str]]:
    rng = random.Random(seed)
    models = [f"m{i}" for i in range(rng.randint(2, 6))]
    cap = rng.randint(1, min(3, len(models) - 1))
    apps = FakeModelApps(start_s=rng.choice([0.0, 0.001, 0.003]))
    pins = rng.random() < 0.5
    registry = Registry(str(tmp_path / f"registry-{seed}.json"), apps=apps)
    await registry.bootstrap({"models": [entry(m) for m in models], "max_loaded_models": cap,
                              "load_timeout_s": PINNED_LOAD_TIMEOUT_S if pins else LOAD_TIMEOUT_S,
                              "evict_mode": rng.choice(["stop", "sleep"]),
                              "max_asleep_models": rng.choice([0, 1, None])})
    schedule = Schedule(rng, registry, apps, cap)
    schedule.pins = pins
    watcher = asyncio.get_running_loop().create_task(schedule.watch())
    weights = [("request", 12), ("unload", 2), ("pin", 1 if schedule.pins else 0), ("remove_and_add", 0.3)]
    calls = []
    for _ in range(rng.randint(4, 16)):
        name = rng.choices([w[0] for w in weights], [w[1] for w in weights])[0]
        target = rng.choices(models, [1 / (i + 1) for i in range(len(models))])[0]  # Zipf-like popularity
        calls.append(_after(rng.choice([0, 0, 0.001, 0.002]), getattr(schedule, name)(target)))
    outcomes = await asyncio.gather(*(_call(call) for call in calls))
    while registry._loads:  # loads nobody waits on any more (their caller failed) finish or fail too
        await asyncio.wait_for(asyncio.gather(*registry._loads.values(), return_exceptions=True), HANG_S)
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    return schedule, list(outcomes)


async def _after(delay: float, work: Any) -> None:
    await asyncio.sleep(delay)
    await work


# Errors a call may end with under these schedules: each is its own 4xx/503, never a hang.
ALLOWED = {"ok", "CapacityError", "ModelReloadingError", "ModelAlreadyUnloadedError", "ModelRemovingError",
           "ModelNotFoundError", "ModelExistsError"}


@pytest.mark.slow
async def test_random_schedules_past_the_cap_always_make_progress(tmp_path: Path) -> None:
    served = 0
    # the state file on a memory file system where there is one: each change is fsynced, ~15 ms on this disk
    folder = Path(tempfile.mkdtemp(dir="/dev/shm")) if os.path.isdir("/dev/shm") else tmp_path
    for seed in range(SCHEDULES):
        schedule, outcomes = await run_schedule(seed, folder)
        assert set(outcomes) <= ALLOWED, (seed, outcomes)
        assert schedule.pins or "CapacityError" not in outcomes, (seed, outcomes)
        assert schedule.most_occupying <= schedule.cap, seed
        assert schedule.most_running <= schedule.cap, seed
        phases = {mid: r.phase for mid, r in schedule.registry.state.models.items()}
        assert not [mid for mid, phase in phases.items() if phase in (Phase.WAITING, Phase.LOADING)], (seed, phases)
        served += schedule.served
    assert served > SCHEDULES * 3  # most requests were served, not refused


async def test_loads_queued_past_the_cap_do_not_wait_on_each_other(tmp_path: Path) -> None:
    """The smallest case of the deadlock: room for one, `a` loaded, then `b` and `c` wanted at once: both load in
    turn at once, neither waits out `load_timeout_s`."""
    apps = FakeModelApps(start_s=0.01)
    registry = Registry(str(tmp_path / "registry.json"), apps=apps)
    await registry.bootstrap({"models": [entry(m) for m in "abc"], "max_loaded_models": 1, "load_timeout_s": 30})
    await registry.ensure_loaded("a")
    await registry.report_usage("router", {}, {"a": (time.time(), None)})
    started = time.monotonic()
    b = asyncio.create_task(registry.ensure_loaded("b"))
    c = asyncio.create_task(registry.ensure_loaded("c"))
    await b
    await registry.report_usage("router", {}, {"b": (time.time(), None)})  # b's request came and went
    await c
    assert time.monotonic() - started < 5
    assert [mid for mid, r in registry.state.models.items() if r.status == "loaded"] == ["c"]


async def test_a_load_that_gets_no_room_in_time_fails_alone(tmp_path: Path) -> None:
    """Room for one, held by a pinned model: a load waits its time and fails with a 503; a request for the pinned
    model is served meanwhile, and nothing is left `reloading`."""
    registry = Registry(str(tmp_path / "registry.json"), apps=FakeModelApps())
    await registry.bootstrap({"models": [entry(m) for m in "ab"], "max_loaded_models": 1, "load_timeout_s": 0.3})
    await registry.ensure_loaded("a")
    await registry.set_pinned("a", True)
    waiting = asyncio.create_task(registry.ensure_loaded("b"))
    await asyncio.sleep(0.05)
    assert await registry.status("b") == "reloading"
    assert await registry.ensure_loaded("a") == "a"
    with pytest.raises(CapacityError):
        await waiting
    assert await registry.status("b") == "unloaded" and await registry.status("a") == "loaded"


async def _queued_behind_a_busy_model(tmp_path: Path, **config: Any) -> tuple[Registry, FakeModelApps, list[Any]]:
    """Room for one, held by `a` with a request in flight; then one request for `b` and, after it, three for `c`."""
    apps = FakeModelApps()
    registry = Registry(str(tmp_path / "registry.json"), apps=apps)
    await registry.bootstrap({"models": [entry(m) for m in "abc"], "max_loaded_models": 1, **config})
    await registry.ensure_loaded("a")
    await registry.report_usage("router", {"a": 1}, {"a": (time.time(), None)})
    waiting = [asyncio.create_task(registry.ensure_loaded("b"))]
    while not registry.evictor.waits_for_room("b"):
        await asyncio.sleep(0.001)
    waiting += [asyncio.create_task(registry.ensure_loaded("c")) for _ in range(3)]
    while registry.evictor.queued("c") != 3 or not registry.evictor.waits_for_room("c"):
        await asyncio.sleep(0.001)
    return registry, apps, waiting


async def test_room_goes_first_to_the_model_with_the_most_requests_queued(tmp_path: Path) -> None:
    registry, apps, waiting = await _queued_behind_a_busy_model(tmp_path)
    await registry.report_usage("router", {}, {"a": (time.time(), None)})  # a's request ends: room for one
    await asyncio.gather(*waiting[1:])
    assert [call for call in apps.calls if call[0] == "deploy"][-1] == ("deploy", app_of(registry, "c"))
    assert not waiting[0].done()  # b waits for c's requests to be reported done
    await registry.report_usage("router", {}, {"c": (time.time(), None)})
    await waiting[0]


async def test_a_load_waiting_past_the_fairness_bound_goes_first(tmp_path: Path) -> None:
    registry, apps, waiting = await _queued_behind_a_busy_model(tmp_path, room_fairness_s=0)
    await registry.report_usage("router", {}, {"a": (time.time(), None)})
    await waiting[0]  # b came first, and every waiting load is past the bound: oldest first
    assert [call for call in apps.calls if call[0] == "deploy"][-1] == ("deploy", app_of(registry, "b"))
    await registry.report_usage("router", {}, {"b": (time.time(), None)})
    await asyncio.gather(*waiting[1:])


async def test_requests_past_a_models_queue_bound_are_refused_at_once(tmp_path: Path) -> None:
    registry, _, waiting = await _queued_behind_a_busy_model(tmp_path, max_queued_requests=3)
    with pytest.raises(CapacityError, match="max_queued_requests"):
        await registry.ensure_loaded("c")  # the fourth for c
    await registry.report_usage("router", {}, {"a": (time.time(), None)})
    await asyncio.gather(*waiting[1:])
    await registry.report_usage("router", {}, {"c": (time.time(), None)})
    await waiting[0]


def app_of(registry: Registry, model_id: str) -> str:
    return registry.state.models[model_id].spec.app_name


async def test_a_popular_model_stays_when_a_rarely_used_one_was_used_since(tmp_path: Path) -> None:
    """Room for two: `a` had ten requests, then `b` one; loading `c` evicts `b`, though `a` was used longer ago."""
    registry = Registry(str(tmp_path / "registry.json"), apps=FakeModelApps())
    await registry.bootstrap({"models": [entry(m) for m in "abc"], "max_loaded_models": 2})
    for model_id, begun in (("a", 10), ("b", 1)):
        await registry.ensure_loaded(model_id)
        await registry.report_usage("router", {}, {model_id: (time.time(), None, begun)})
    await registry.ensure_loaded("c")
    assert {mid: r.status for mid, r in registry.state.models.items()} == {
        "a": "loaded", "b": "unloaded", "c": "loaded"}


async def test_a_sleeping_replica_is_stopped_when_a_new_one_needs_what_it_holds(tmp_path: Path) -> None:
    """Room for one loaded model on a node that holds two replicas: `a` and `b` evicted to sleep still hold theirs,
    so loading `c` stops the least recently used sleeper (`a`), and `c` starts."""
    apps = FakeModelApps(replica_slots=2)
    registry = Registry(str(tmp_path / "registry.json"), apps=apps)
    await registry.bootstrap({"models": [entry(m) for m in "abc"], "max_loaded_models": 1, "evict_mode": "sleep"})
    for model_id in "abc":
        await registry.ensure_loaded(model_id)
        await registry.report_usage("router", {}, {model_id: (time.time(), None)})
    phases = {mid: r.phase for mid, r in registry.state.models.items()}
    assert phases == {"a": Phase.STOPPED, "b": Phase.ASLEEP, "c": Phase.LOADED}
    assert registry.state.models["a"].unloaded_reason == "evicted: resources"
