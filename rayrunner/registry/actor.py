"""The registry: a detached, named Ray actor that owns every model's spec, status, aliases and the default.

Every change to one model runs under that model's lock, so two loads (or a load and an unload) never overlap, and
is written to the state file before it is acknowledged. The actor runs one event loop: a check and the change it
guards with no `await` between them (add, set_default, add_alias, starting a load) cannot interleave with another
call; where an `await` separates them (unload, remove, a queued load), the check is made again under the model's
lock. A model being removed refuses every other change (409 `model_removing`) until it is gone, and a load queued
behind a remove gives up instead of deploying a deleted model. Loads are single-flight: concurrent requests for an
unloaded model all wait on the same load. After a restart the actor reads its file back and checks each model
against what Serve is actually running. Every saved change also bumps a version that routers long-poll
(`routing_table`), so they route without asking the registry per request.

What is done to a model's Serve app (deploy, wake, rescale, unload, clean up a failed load) is the registry's
`AppDriver` (`rayrunner.registry.app_driver`). Capacity (`max_loaded_models`, `max_loaded_bytes`) and the keep_alive
timer are its `Evictor` (`rayrunner.registry.evictor`), which evicts idle models through the driver's unload. Both
know use from the routers' batched `report_usage` calls: each router replica counts its open requests per model and
sends its counts and last-use times at most every half second, never per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import ray

from rayrunner.errors import (
    ModelAlreadyLoadedError,
    ModelAlreadyUnloadedError,
    ModelLoadError,
    ModelNotFoundError,
    ModelReloadingError,
    ModelRemovingError,
    UnplaceableModelError,
    unwrap,
)
from rayrunner.models import load_progress
from rayrunner.models.keep_alive import KeepAlive
from rayrunner.registry.app_driver import AppDriver, LoadMode
from rayrunner.registry.config import RegistryConfig
from rayrunner.registry.evictor import Evictor
from rayrunner.registry.lifecycle import PHASES, Phase
from rayrunner.registry.model_apps import ModelApps, ServeModelApps
from rayrunner.registry.replica_watch import watch_replicas
from rayrunner.registry.state import ModelEntry, ModelRecord, RegistryState, UnloadMode
from rayrunner.runtime import logs, metrics, ray_private
from rayrunner.runtime.cache_dir import cache_dir

REGISTRY_NAME = "rayrunner-registry"
NAMESPACE = "rayrunner"
DEFAULT_APP = "rayrunner"

logger = logging.getLogger(__name__)


class Registry:
    def __init__(self, state_path: str, apps: ModelApps | None = None) -> None:
        self.apps: ModelApps = apps or ServeModelApps()  # Serve in production, a fake in tests
        self.path = Path(state_path)
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:  # the actor itself
            logs.to_actor_log(self.path.with_suffix(".log"))
        self.state = RegistryState.load(self.path)
        self.config = RegistryConfig.model_validate(self.state.settings)
        self._locks: dict[str, asyncio.Lock] = {}
        self._removing: set[str] = set()
        self._loads: dict[str, asyncio.Task[None]] = {}
        self._reconciled = False
        self._epoch = uuid.uuid4().hex  # a restarted registry is a new epoch, so routers never trust old versions
        self._changes = 0
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.driver = AppDriver(self.config, self.apps, persist=self._persist,  # late-bound: the evictor is built next
                                stop_sleepers=lambda record: self.evictor.stop_sleepers_for(record))
        self.evictor = Evictor(self.state, self.config, self.apps, lock=self._lock, unload=self.driver.unload,
                               loading=self._loads, spawn=self._spawn)

    # ------------------------------------------------------------ start-up

    async def bootstrap(self, config: dict[str, Any]) -> list[str]:
        """Apply the config (it wins for the models it declares; see `RegistryState.apply_config`), then settle
        every model against Serve. Returns what changed, as logged."""
        self.config = self.evictor.config = self.driver.config = RegistryConfig.model_validate(config)
        self.state.settings = self.config.model_dump(mode="json", exclude={"models", "default_model", "auth"})
        changes = self.state.apply_config(self.config.models, self.config.default_model)
        for line in changes.log:
            logger.info("config: %s", line)
        self._persist()
        declared = {entry.spec.model_id: entry for entry in self.config.models}
        await self._ensure_reconciled()  # starts the idle timer; the reconcile below settles every model
        # a LoRA model served by its host's replica loads by loading that host
        to_load = {self.state.serving(mid).spec.model_id for mid in changes.added if declared[mid].load}
        await self._reconcile(to_load, set(changes.respecified), set(changes.rescaled))
        return changes.log

    async def _ensure_reconciled(self) -> None:
        if self.evictor.start():  # the first call: the keep_alive timer and the replica watch begin
            self._spawn(watch_replicas(self.apps, lambda: {r.spec.app_name: mid for mid, r in self.state.models.items()
                                                           if self.state.host_of(mid) is None}))
        if not self._reconciled:
            await self._reconcile(set(), set(), set())

    async def _reconcile(self, to_load: set[str], respecified: set[str], rescaled: set[str]) -> None:
        """Make each status match Serve: adopt running apps, wait for starting ones, load new `load: true` ones,
        redeploy a running model whose spec the config changed unless the config itself deployed it so, and
        rescale in place one whose replica count or routing alone changed.

        Models known from an earlier run keep the status they had: an unloaded model stays unloaded across router
        redeploys, and a loaded one whose app is gone (the whole service was stopped) loads again."""
        self._reconciled = True
        for model_id, record in self.state.models.items():
            if model_id in self._loads:
                continue
            if self.state.host_of(model_id) is not None:  # served by its host's replica: loads with the host
                record.observe(Phase.STOPPED)
                continue
            state = await self.apps.state(record.spec.app_name)
            running = state.running >= 1 and state.deployment_status == "HEALTHY"
            starting = state.exists and state.deployment_status not in ("HEALTHY", "DEPLOY_FAILED", "UNHEALTHY")
            if (running or starting) and model_id in respecified and not await self.driver.runs_spec(record.spec):
                record.observe(Phase.LOADED)
                if running and model_id in rescaled:
                    self._spawn(self._rescale(record))
                else:
                    logger.info("config: redeploying `%s`, which runs the spec the config replaced", model_id)
                    self._start_load(record, mode="replace")
            elif running and await self.apps.replica_asleep(record.spec.app_name):  # running is known: ask the replica
                record.observe(Phase.ASLEEP)
            elif running:
                record.observe(Phase.LOADED)
            elif starting:
                record.observe(Phase.STOPPED)
                self._start_load(record, mode="adopt")  # a config deploy or a scale-up is under way
            elif model_id in to_load or record.status in ("loaded", "reloading"):
                record.observe(Phase.STOPPED)
                self._start_load(record)
            else:
                record.observe(Phase.FAILED if record.phase == Phase.FAILED else Phase.STOPPED)
        self._persist()

    # ------------------------------------------------------------ queries

    async def resolve(self, name: str) -> dict[str, Any]:
        """Routing facts for an id, alias or `default`."""
        await self._ensure_reconciled()
        return self.state.route(self.state.resolve(name))

    async def routing_table(self, known: list[Any] | None = None, wait_s: float = 30.0) -> dict[str, Any]:
        """Every name's route and the table's version. A long poll: when `known` is the current version, answers
        at the next change (or after `wait_s`, unchanged)."""
        await self._ensure_reconciled()
        if known == self._version():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
        return {"version": self._version(), "routes": self.state.routes()}

    def _version(self) -> list[Any]:
        return [self._epoch, self._changes]

    async def cards(self) -> list[dict[str, Any]]:
        await self._ensure_reconciled()
        replicas = await self.driver.replica_counts()
        return [self._card(mid, replicas) for mid in self.state.models]

    async def card(self, name: str) -> dict[str, Any]:
        await self._ensure_reconciled()
        return self._card(self.state.resolve(name), await self.driver.replica_counts())

    async def status(self, name: str) -> str:
        await self._ensure_reconciled()
        return self.state.record(name).status

    async def default_id(self) -> str | None:
        return self.state.default_id

    def _card(self, model_id: str, replicas: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
        """The model's card; with `replicas` (Serve's counts per app, `driver.replica_counts`), its own among them."""
        record = self.state.models[model_id]
        card = record.model_dump(mode="json")
        host = self.state.host_of(model_id)
        if host is not None:  # a LoRA model lives and dies with its host's replica
            card.update(status=self.state.models[host].status, served_by=host)
        serving = self.state.models[host or model_id]
        if serving.status == "reloading":  # the phase its replica pushes while loading
            card["load_progress"] = load_progress.read(serving.spec.app_name)
        if replicas is not None:
            card["replicas"] = replicas.get(serving.spec.app_name, {"running": 0, "starting": 0, "target": 0})
        return {**card, "model_id": model_id, "kind": record.spec.kind, "is_default": model_id == self.state.default_id,
                "in_flight": self.evictor.in_flight(model_id)}

    async def report_usage(self, router_id: str, in_flight: dict[str, int],
                           used: dict[str, tuple[float, KeepAlive] | tuple[float, KeepAlive, int]]) -> None:
        """A router replica's batch of use (`Evictor.report_usage`): its open requests per model now, and per model
        used since its last report the last use time, its request's keep_alive and how many requests began."""
        self.evictor.report_usage(router_id, in_flight, used)

    # ------------------------------------------------------------ lifecycle

    async def ensure_loaded(self, name: str) -> str:
        """Auto-reload: return once the model is loaded, joining a load already under way."""
        await self._ensure_reconciled()
        record = self.state.serving(self._changeable(name))
        record.last_used_at = time.time()
        model_id = record.spec.model_id
        if record.status != "loaded":
            with self.evictor.queue(model_id):  # a 503 past max_queued_requests
                await asyncio.shield(self._loads.get(model_id) or self._start_load(record))
        self.evictor.claim(model_id)
        return model_id

    async def reload(self, name: str) -> dict[str, Any]:
        await self._ensure_reconciled()
        requested = self._changeable(name)
        record = self.state.serving(requested)
        if record.status == "loaded":
            raise ModelAlreadyLoadedError(record.spec.model_id)
        if record.status == "reloading" or record.spec.model_id in self._loads:
            raise ModelReloadingError(record.spec.model_id)
        await asyncio.shield(self._start_load(record))
        return self._card(requested)

    async def unload(self, name: str, mode: UnloadMode = "stop") -> dict[str, Any]:
        """`stop`: scale to zero replicas; `sleep`: the replica frees its weights and stays, to wake quickly."""
        await self._ensure_reconciled()
        requested = self._changeable(name)
        record = self.state.serving(requested)  # a LoRA model unloads with its host
        model_id = record.spec.model_id
        self._check_unloadable(record, mode)  # fails fast, without waiting for the lock
        async with self._lock(model_id):
            self._check_current(record)
            self._check_unloadable(record, mode)  # again: another unload may have run while this one waited
            # the default stays here: a request for `default` reloads it
            await self.driver.unload(record, "user", mode)
        return self._card(requested)

    @staticmethod
    def _check_unloadable(record: ModelRecord, mode: UnloadMode) -> None:
        if record.status == "reloading":
            raise ModelReloadingError(record.spec.model_id)
        if record.status == "unloaded" and not (mode == "stop" and record.unload_mode == "sleep"):
            raise ModelAlreadyUnloadedError(record.spec.model_id)  # (a sleeping model may still be stopped)

    async def add(self, entry: dict[str, Any]) -> dict[str, Any]:
        """Register and (with `load`) load a model. For an id already registered with the same spec this attaches
        instead: it adds missing aliases and, with `load`, loads the model if it is not loaded; another spec under
        that id raises `SpecMismatchError` (a `ModelExistsError`). The card's `attached` says which it was."""
        await self._ensure_reconciled()
        parsed = ModelEntry.model_validate(entry)
        model_id = parsed.spec.model_id
        if model_id in self.state.models:
            self._changeable(model_id)
            registered = self.state.models[model_id].spec.engine.sources  # set by the registry, never by a caller
            self.state.attach(parsed.spec.carrying(registered), parsed.aliases).configure(parsed)
            self._persist()
            if parsed.load:
                await self.ensure_loaded(model_id)
            return {**self._card(model_id), "attached": True}
        spec = parsed.spec.confined(self.config.sources)  # a new model added at runtime: allowed sources and settings
        self.state.check_new(model_id, parsed.aliases)
        record = self.state.add(spec, parsed.aliases)
        record.configure(parsed)
        self._persist()
        if parsed.load:
            await self.ensure_loaded(model_id)  # a LoRA model with a host: its host
        return {**self._card(model_id), "attached": False}

    async def remove(self, name: str) -> dict[str, Any]:
        """Forget a model and delete its app. From the first check on, every other change to it is refused."""
        await self._ensure_reconciled()
        model_id = self._changeable(name)
        record = self.state.models[model_id]
        if record.status == "reloading":
            raise ModelReloadingError(model_id)
        self._removing.add(model_id)
        try:
            async with self._lock(model_id):
                self._check_current(record)
                if record.status == "reloading":  # a load queued before this remove started
                    raise ModelReloadingError(model_id)
                await self.apps.delete(record.spec.app_name)
                self.state.remove(model_id)
                metrics.model_status(model_id, "removed")  # every status gauge of the model to 0
                self._persist()
        finally:
            self._removing.discard(model_id)
        self._locks.pop(model_id, None)  # a later model of that id gets a fresh lock
        return {"model_id": model_id, "removed": True}

    async def set_default(self, name: str) -> dict[str, Any]:
        await self._ensure_reconciled()
        model_id = self.state.set_default(self._changeable(name))
        self._persist()
        return self._card(model_id)

    async def set_pinned(self, name: str, pinned: bool) -> dict[str, Any]:
        """Pin (never evicted to make room for another model; keep_alive still applies) or unpin a model. Saved,
        and kept when a router restarts with the same config (`ModelRecord.configure_declared`)."""
        await self._ensure_reconciled()
        model_id = self._changeable(name)
        record = self.state.models[model_id]
        if record.pinned != pinned:
            record.pinned = pinned
            self._persist()
        return self._card(model_id)

    async def scale(self, name: str, changes: dict[str, Any]) -> dict[str, Any]:
        """New replica settings for a model (`ModelSpec.rescaled`): saved, and a loaded model rescales in place."""
        await self._ensure_reconciled()
        record = self.state.models[self._changeable(name)]
        record.spec = record.spec.rescaled(changes)
        self._persist()
        if record.status == "loaded":
            await self._rescale(record)
        return self._card(record.spec.model_id, await self.driver.replica_counts())  # the target moved already

    async def add_alias(self, model_id: str, alias: str) -> dict[str, Any]:
        await self._ensure_reconciled()
        resolved = self._changeable(model_id)
        if self.state.add_alias(resolved, alias):
            self._persist()
        return self._card(resolved)

    # ------------------------------------------------------------ internals

    def _lock(self, model_id: str) -> asyncio.Lock:
        return self._locks.setdefault(model_id, asyncio.Lock())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(_logged(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _changeable(self, name: str) -> str:
        """The model id `name` resolves to, unless that model (or a LoRA model's host) is being removed."""
        model_id = self.state.resolve(name)
        for affected in (model_id, self.state.serving(model_id).spec.model_id):
            if affected in self._removing:
                raise ModelRemovingError(affected)
        return model_id

    def _check_current(self, record: ModelRecord) -> None:
        """Under the model's lock: the record is still the registered one (not removed while the caller waited)."""
        if self.state.models.get(record.spec.model_id) is not record:
            raise ModelNotFoundError(record.spec.model_id)

    def _start_load(self, record: ModelRecord, mode: LoadMode = "deploy") -> asyncio.Task[None]:
        """Queue the model's load now (`reloading`, so later callers join), and load it in a task once it has room:
        `deploy` its spec, `adopt` a deploy already under way, or `replace` a running app (deleted first, so the old
        replica is gone before the new one loads, and its memory with it)."""
        model_id = record.spec.model_id
        record.move(Phase.WAITING)
        self._persist()
        task = asyncio.get_running_loop().create_task(self._load(record, mode))
        self._loads[model_id] = task
        task.add_done_callback(lambda done: self._forget_load(model_id, done))
        return task

    def _forget_load(self, model_id: str, task: asyncio.Task[None]) -> None:
        self._loads.pop(model_id, None)
        if not task.cancelled():
            task.exception()  # retrieved here: a failed load is reported to its waiters and in `last_error`

    async def _load(self, record: ModelRecord, mode: LoadMode) -> None:
        spec = record.spec
        async with self._lock(spec.model_id):
            self._check_current(record)  # removed while this load waited: deploy nothing
            try:
                if mode == "adopt":  # already deployed: it holds its room whatever the limits say
                    record.move(Phase.LOADING)
                else:  # with no room it goes back to where it was, and the waiters get the capacity error as it is
                    await self.evictor.make_room(record)
            finally:
                self._persist()
            started = time.monotonic()
            try:
                record.info, deployed_at = await self.driver.replica_up(record, mode)
                record.estimated_bytes = None  # estimated again from the measured weights
                await self.evictor.footprint(record)
            except Exception as exc:
                await self.driver.fail_load(record, exc)
                refused = unwrap(exc)
                if isinstance(refused, UnplaceableModelError):  # no node can hold it: a 400, not a load failure
                    raise refused from None
                raise ModelLoadError(record.last_error or str(exc)) from None
            seconds = time.monotonic() - started
            record.mark_loaded(seconds)
            self._persist()
            how = "adopted" if mode == "adopt" else "woken" if deployed_at is None else "started"
            logger.info("loaded `%s` (%s, %.2f s)", spec.model_id, how, seconds)
            metrics.model_loaded(spec.model_id, seconds, record.info.get("weight_bytes"))
            if deployed_at is not None or mode == "adopt":  # the next replica on that node starts in a warm worker
                self._spawn(self.apps.after_load(spec.app_name, deployed_at, self.config.warm_spares))

    async def _rescale(self, record: ModelRecord) -> None:
        """Deploy a running model's new replica count or routing as the version that runs, with the same replica
        arguments (`ModelSpec.replica_args`): Serve adds or drains replicas and restarts none (the version is saved
        with the model; without one, Serve replaces the replicas one by one). It stays `loaded`."""
        async with self._lock(record.spec.model_id):
            if record.status != "loaded":
                return  # unloaded meanwhile: the next load deploys the new count
            await self.driver.rescale(record)

    def _persist(self) -> None:
        self.state.save(self.path)
        for model_id, record in self.state.models.items():
            metrics.model_status(model_id, record.status)
            metrics.model_phase(model_id, record.phase, PHASES)
        self._changes += 1
        self._changed.set()  # wakes every routing_table long poll; later polls wait on a fresh event
        self._changed = asyncio.Event()
        self.evictor.changed()


async def _logged(work: Coroutine[Any, Any, None]) -> None:
    try:
        await work
    except Exception:
        logger.exception("background work failed")


RegistryActor = ray.remote(Registry)


def registry_name(app_name: str = DEFAULT_APP) -> str:
    """The registry actor's name for the router app `app_name`: one registry per service, never shared by accident
    between two services on one cluster."""
    return REGISTRY_NAME if app_name == DEFAULT_APP else f"{REGISTRY_NAME}-{app_name}"


def default_state_path(app_name: str = DEFAULT_APP) -> str:
    """`$RAYRUNNER_CACHE_DIR/registry.json` for the default app, `registry-<app>.json` for any other."""
    name = "registry.json" if app_name == DEFAULT_APP else f"registry-{app_name}.json"
    return str(cache_dir() / name)


def get_registry(app_name: str = DEFAULT_APP, state_path: str | None = None) -> Any:
    """The registry of the router app `app_name`: created detached on first use, found by name afterwards (it
    outlives redeploys)."""
    return RegistryActor.options(
        name=registry_name(app_name),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        max_task_retries=0,
        num_cpus=0,
        resources={ray_private.HEAD_NODE_RESOURCE: 0.001},  # the head outlives every worker; its state file is local
        max_concurrency=1000,
    ).remote(state_path or default_state_path(app_name))
