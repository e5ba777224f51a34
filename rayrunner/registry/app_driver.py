"""What the registry does to a model's Serve app: bring its replica up (deploy, wake or adopt), rescale it in place,
unload it (stop or sleep), clean up after a failed load, and read back what Serve runs (the spec a config deployed,
replica counts).

`AppDriver` is an object the registry (`rayrunner.registry.actor.Registry`) owns, built with what it works on passed
in: the config, the model apps, how to save a change (`persist`) and how to free what a new replica needs
(`stop_sleepers`, the evictor's). Every call is made under the model's lock, which the caller holds; the driver
takes no lock and holds no Ray, so tests drive it through the registry against a fake `ModelApps`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from rayrunner.errors import ModelLoadError, as_rayrunner_error
from rayrunner.models import load_progress
from rayrunner.models.spec import ModelSpec
from rayrunner.registry.config import RegistryConfig
from rayrunner.registry.model_apps import ModelApps
from rayrunner.registry.state import ModelRecord, UnloadMode
from rayrunner.runtime import metrics

logger = logging.getLogger(__name__)
LoadMode = Literal["deploy", "adopt", "replace"]


class AppDriver:
    """Deploys, wakes, rescales, unloads and cleans up model apps (see the module docstring)."""

    def __init__(self, config: RegistryConfig, apps: ModelApps, *, persist: Callable[[], None],
                 stop_sleepers: Callable[[ModelRecord], Awaitable[None]]) -> None:
        self.config, self.apps = config, apps  # the registry replaces `config` on bootstrap
        self._persist, self._stop_sleepers = persist, stop_sleepers

    async def replica_up(self, record: ModelRecord, mode: LoadMode) -> tuple[dict[str, Any], float | None]:
        """Bring the model's replica up by `mode`: its info, and the wall time of a fresh deploy (None for a wake or
        an adoption, which start no worker)."""
        app = record.spec.app_name
        if mode == "replace":
            await self.apps.delete(app)
        if mode == "deploy" and record.unload_mode == "sleep" and await self.apps.asleep(app):
            woken = await asyncio.wait_for(self.apps.wake(app), self.config.load_timeout_s)
            return woken, None  # the replica answered: it runs, and wake answers its info
        if mode == "adopt":
            await self.apps.wait_loaded(app, self.config.load_timeout_s)
            return await self.apps.info(app), None
        await self._stop_sleepers(record)
        deployed_at = time.time()
        record.deployed_version = uuid.uuid4().hex
        await self._bring_up(record.spec, record.deployed_version)
        return await self.apps.new_replica_info(app, deployed_at, self.config.load_timeout_s), deployed_at

    async def rescale(self, record: ModelRecord) -> None:
        """Deploy a loaded model's new replica count or routing as the version that runs (see `Registry._rescale`)."""
        logger.info("rescaling `%s` in place to %s", record.spec.model_id,
                    record.spec.engine.serve_options())
        await self._bring_up(record.spec, record.deployed_version)

    async def unload(self, record: ModelRecord, reason: str, mode: UnloadMode) -> None:
        """Unload by `mode` (caller holds the lock). Sleep: the replica drains, frees its weights and stays."""
        if mode == "stop":
            await self._scale_down(record, reason)
            return
        self._mark_unloaded(record, reason, "sleep")
        try:
            record.info = await self.apps.sleep(record.spec.app_name)
        except Exception:
            logger.exception("`%s` could not sleep: stopping it instead", record.spec.model_id)
            await self._scale_down(record, reason)
            return
        self._persist()

    async def fail_load(self, record: ModelRecord, exc: BaseException) -> None:
        """Never leave a model stuck: back to `unloaded`, the cause in `last_error`, no half-started app."""
        error = as_rayrunner_error(exc)
        metrics.model_load_failed(record.spec.model_id)
        record.mark_failed(ModelLoadError(error.message).message)
        self._persist()
        # The app may never have been created; the record is already consistent either way.
        try:
            await self.apps.delete(record.spec.app_name)
        except Exception:
            logger.warning("`%s`: its failed app could not be deleted", record.spec.model_id, exc_info=True)
        load_progress.clear(record.spec.app_name)  # after the delete: a replica still loading wrote until then

    async def runs_spec(self, spec: ModelSpec) -> bool:
        """Whether the model's app was deployed (by a config) with exactly `spec`; unknown counts as no."""
        try:
            args = await self.apps.deployed_args(spec.app_name)
            return args is not None and ModelSpec.model_validate(args) == spec
        except Exception:
            logger.warning("`%s`: cannot read the spec its app runs; redeploying it", spec.model_id, exc_info=True)
            return False

    async def replica_counts(self) -> dict[str, dict[str, int]]:
        """Each model app's replicas (running, starting, target); none when Serve cannot tell right now."""
        try:
            return await self.apps.replica_counts()
        except Exception:
            logger.warning("replica counts unavailable", exc_info=True)
            return {}

    def _mark_unloaded(self, record: ModelRecord, reason: str, mode: UnloadMode) -> None:
        record.mark_unloaded(reason, mode)
        metrics.model_unloaded(record.spec.model_id, reason, mode)
        self._persist()

    async def _scale_down(self, record: ModelRecord, reason: str) -> None:
        """Unload (caller holds the model's lock): `unloaded` at once, then the replicas drain and exit. An
        autoscaled model's app is deleted instead (Serve's autoscaler would scale it back to its minimum); the next
        load deploys it again, as after any stop."""
        self._mark_unloaded(record, reason, "stop")
        if record.spec.engine.autoscaling_config is not None:
            await asyncio.wait_for(self.apps.delete(record.spec.app_name), self.config.unload_timeout_s)
        else:
            await self.apps.scale_to_zero(record.spec.app_name, self.config.unload_timeout_s)
        record.info = {}
        self._persist()

    async def _bring_up(self, spec: ModelSpec, version: str | None) -> None:
        # A load is a fresh deploy (a new version), not a scale-up: Serve reports a broken constructor of a new
        # deployment version as DEPLOY_FAILED at once, while a failing scale-up of an old one retries forever.
        await asyncio.wait_for(self.apps.deploy(spec, version), self.config.load_timeout_s)
