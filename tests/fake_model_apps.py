"""An in-memory `ModelApps`: model apps that start, sleep and stop at once (or after `start_s`), so the registry's
lifecycle logic runs in process without a cluster. It records every call, and a model id in `failing` fails to
start with `ModelLoadError`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from rayrunner.errors import ModelLoadError
from rayrunner.models.spec import ModelSpec
from rayrunner.registry.model_apps import AppState


@dataclass
class FakeApp:
    spec: ModelSpec
    running: bool = False
    asleep: bool = False
    started_at: float = 0.0
    failed: str = ""
    scaled_to_zero: bool = False  # as Serve reports it: healthy, with no replica


@dataclass
class FakeModelApps:
    start_s: float = 0.0
    failing: set[str] = field(default_factory=set)
    apps: dict[str, FakeApp] = field(default_factory=dict)
    calls: list[tuple[str, str]] = field(default_factory=list)
    replica_slots: int | None = None  # replicas (awake or asleep) the node holds at once; None: any number

    def deploys(self, app: str) -> int:
        return sum(1 for call in self.calls if call == ("deploy", app))

    async def state(self, app: str) -> AppState:
        found = self.apps.get(app)
        if found is None:
            return AppState(exists=False)
        if found.failed:
            return AppState(exists=True, app_status="DEPLOY_FAILED", deployment_status="UNHEALTHY",
                            message=found.failed)
        running = int(found.running)
        settled = running or found.scaled_to_zero
        return AppState(exists=True, app_status="RUNNING" if settled else "DEPLOYING",
                        deployment_status="HEALTHY" if settled else "UPDATING", running=running, total=running)

    async def deployed_args(self, app: str) -> dict[str, Any] | None:
        found = self.apps.get(app)
        return None if found is None else found.spec.model_dump(mode="json")

    async def replica_counts(self) -> dict[str, dict[str, int]]:
        return {name: {"running": int(app.running), "starting": 0, "target": int(app.running)}
                for name, app in self.apps.items()}

    async def deploy(self, spec: ModelSpec, version: str | None = None) -> None:
        self.calls.append(("deploy", spec.app_name))
        full = not await self.fits_now(spec)  # Serve would leave the replica pending: here it fails at once
        self.apps[spec.app_name] = app = FakeApp(spec, failed="no node has room for the replica" if full else "")
        asyncio.get_running_loop().create_task(self._start(app))

    async def _start(self, app: FakeApp) -> None:
        await asyncio.sleep(self.start_s)
        if app.failed:
            return
        if app.spec.model_id in self.failing:
            app.failed = f"{app.spec.model_id} failed to start"
        else:
            app.running, app.started_at = True, time.time()

    async def wait_loaded(self, app: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            found = self.apps.get(app)
            if found is not None and found.failed:
                raise ModelLoadError(found.failed)
            if found is not None and found.running:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(app)
            await asyncio.sleep(0.005)

    async def new_replica_info(self, app: str, deployed_at: float, timeout_s: float) -> dict[str, Any]:
        await self.wait_loaded(app, timeout_s)
        return await self.info(app)

    async def scale_to_zero(self, app: str, timeout_s: float) -> None:
        self.calls.append(("scale_to_zero", app))
        if app in self.apps:
            found = self.apps[app]
            found.running = found.asleep = False
            found.scaled_to_zero = True

    async def delete(self, app: str) -> None:
        self.calls.append(("delete", app))
        self.apps.pop(app, None)

    async def info(self, app: str) -> dict[str, Any]:
        found = self.apps[app]
        return {"started_at": found.started_at, "asleep": found.asleep, "weight_bytes": 1000}

    async def sleep(self, app: str) -> dict[str, Any]:
        self.calls.append(("sleep", app))
        self.apps[app].asleep = True
        return await self.info(app)

    async def wake(self, app: str) -> dict[str, Any]:
        self.calls.append(("wake", app))
        self.apps[app].asleep = False
        return await self.info(app)

    async def asleep(self, app: str) -> bool:
        found = self.apps.get(app)
        return found is not None and found.running and found.asleep

    async def replica_asleep(self, app: str) -> bool:
        return await self.asleep(app)

    async def after_load(self, app: str, deployed_at: float | None, spares: int) -> None:
        self.calls.append(("after_load", app))

    async def fits_now(self, spec: ModelSpec) -> bool:
        return self.replica_slots is None or sum(app.running for app in self.apps.values()) < self.replica_slots
