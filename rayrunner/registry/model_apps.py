"""Model applications on Ray Serve: deploy, scale to zero, wait for a state, delete, ask the replica.

The registry drives them through the `ModelApps` interface: `ServeModelApps` here, an in-memory fake in tests
(`tests/fake_model_apps.py`), so its lifecycle logic runs without a cluster.

Unload uses Serve's external scaling API (`POST /api/v1/applications/{app}/deployments/{dep}/scale` on the
dashboard): the replica drains and exits, while the app, its config and its dashboard entry stay and no other app
is touched. Reload deploys the app again from the saved spec (`serve.run_many`) rather than scaling back up: a new
deployment version whose constructor fails is reported DEPLOY_FAILED at once, whereas a failing scale-up of the old
version is retried by Serve without end, which would leave the model stuck in `reloading`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import httpx
from ray import serve

from rayrunner.errors import ModelLoadError, ModelTimeoutError
from rayrunner.models.spec import ModelSpec
from rayrunner.registry.placement import check_placeable, missing, replica_demand
from rayrunner.replica.model_server import DEPLOYMENT, model_deployment
from rayrunner.runtime import ray_private
from rayrunner.runtime.warm_workers import SPARE_DELAY_S, WarmSpares

logger = logging.getLogger(__name__)
_POLL_S = 0.2
_FAILED = {"DEPLOY_FAILED", "UNHEALTHY"}
# A deployment with a running replica serves in these; a load returns at its first replica (the rest still start).
_SERVING = {"HEALTHY", "UPDATING", "UPSCALING", "DOWNSCALING"}
# Held around Serve calls that build Serve config objects (`serve.status()`, building a deployment): each pickles
# the request router by registering its module for pickling by value and unregistering it after, which is not
# thread-safe; two at once in one process fail with "... is not registered for pickle by value".
_SERVE_CONFIG_LOCK = threading.Lock()


@dataclass
class AppState:
    """What Serve says about one model app right now."""

    exists: bool
    app_status: str = "NOT_STARTED"
    deployment_status: str = ""
    running: int = 0
    total: int = 0
    message: str = ""


def dashboard_url() -> str:
    """`$RAYRUNNER_DASHBOARD_URL`, else the address the cluster published for its dashboard."""
    url = os.environ.get("RAYRUNNER_DASHBOARD_URL")
    if not url:
        url = ray_private.dashboard_url()
    if not url:
        raise ModelLoadError("the Ray dashboard is not running; rayrunner scales models through it")
    return url if url.startswith("http") else f"http://{url}"


def app_state(app: str) -> AppState:
    with _SERVE_CONFIG_LOCK:
        status = serve.status().applications.get(app)
    if status is None:
        return AppState(exists=False)
    deployment = status.deployments.get(DEPLOYMENT)
    if deployment is None:
        return AppState(exists=True, app_status=str(status.status.value), message=status.message)
    states = {str(k.value if hasattr(k, "value") else k): v for k, v in deployment.replica_states.items()}
    return AppState(
        exists=True,
        app_status=str(status.status.value),
        deployment_status=str(deployment.status.value),
        running=states.get("RUNNING", 0),
        total=sum(states.values()),
        message=deployment.message or status.message,
    )


def _failure_message(state: AppState) -> str:
    # Serve's message embeds the replica's traceback; its last line names the real cause. One of our own errors
    # is named by its message alone (its class would repeat the `failed to reload model:` prefix).
    lines = [line.strip() for line in state.message.strip().splitlines() if line.strip()]
    if not lines:
        return f"deployment is {state.deployment_status}"
    return re.sub(r"^rayrunner\.errors\.\w+: ", "", lines[-1])


class ModelApps(Protocol):
    """What the registry needs from the platform that runs model replicas, one app per model."""

    async def state(self, app: str) -> AppState: ...
    async def deployed_args(self, app: str) -> dict[str, Any] | None: ...
    async def replica_counts(self) -> dict[str, dict[str, int]]: ...
    async def deploy(self, spec: ModelSpec, version: str | None = None) -> None: ...
    async def wait_loaded(self, app: str, timeout_s: float) -> None: ...
    async def new_replica_info(self, app: str, deployed_at: float, timeout_s: float) -> dict[str, Any]: ...
    async def scale_to_zero(self, app: str, timeout_s: float) -> None: ...
    async def delete(self, app: str) -> None: ...
    async def info(self, app: str) -> dict[str, Any]: ...
    async def sleep(self, app: str) -> dict[str, Any]: ...
    async def wake(self, app: str) -> dict[str, Any]: ...
    async def asleep(self, app: str) -> bool: ...
    async def replica_asleep(self, app: str) -> bool: ...
    async def after_load(self, app: str, deployed_at: float | None, spares: int) -> None: ...
    async def fits_now(self, spec: ModelSpec) -> bool: ...


class ServeModelApps:
    """`ModelApps` on Ray Serve, with a warm spare worker after each load."""

    def __init__(self) -> None:
        self._spares = WarmSpares()

    async def state(self, app: str) -> AppState:
        return await asyncio.to_thread(app_state, app)

    async def deployed_args(self, app: str) -> dict[str, Any] | None:
        """The `args` a config (`serve run` / `serve deploy`) deployed the app with; None for an app deployed from
        code (as the registry does) or not deployed at all. Read from the dashboard's Serve REST API."""
        async with httpx.AsyncClient(timeout=30, headers=ray_private.dashboard_headers()) as client:
            response = await client.get(f"{dashboard_url()}/api/serve/applications/")
        response.raise_for_status()
        details = response.json().get("applications", {}).get(app) or {}
        args: dict[str, Any] | None = (details.get("deployed_app_config") or {}).get("args")
        return args

    async def replica_counts(self) -> dict[str, dict[str, int]]:
        """Each app's replicas now: `running`, `starting` and Serve's current `target` (an autoscaled model's moves
        with load). One read of the dashboard's Serve REST API for every app."""
        async with httpx.AsyncClient(timeout=30, headers=ray_private.dashboard_headers()) as client:
            response = await client.get(f"{dashboard_url()}/api/serve/applications/")
        response.raise_for_status()
        counts = {}
        for app, details in (response.json().get("applications") or {}).items():
            deployment = (details.get("deployments") or {}).get(DEPLOYMENT)
            if deployment is None:
                continue
            states = [replica.get("state") for replica in deployment.get("replicas") or []]
            counts[app] = {"running": states.count("RUNNING"), "starting": states.count("STARTING"),
                           "target": int(deployment.get("target_num_replicas") or 0)}
        return counts

    async def deploy(self, spec: ModelSpec, version: str | None = None) -> None:
        """Submit the model's app to Serve (as `version`, see `model_deployment`); `wait_loaded` then follows it to
        RUNNING or to its failure. A replica that no node of the cluster could ever hold is refused first
        (`UnplaceableModelError`).

        Not `serve.run`: it polls the app once a second, which rounded every reload up to the next whole second."""

        def submit() -> None:
            check_placeable(spec)  # a replica no node can hold would stay PENDING until the load times out
            with _SERVE_CONFIG_LOCK:
                target = serve.RunTarget(model_deployment(spec, version), name=spec.app_name, route_prefix=None,
                                         external_scaler_enabled=True)
                serve.run_many([target], wait_for_applications_running=False)

        await asyncio.to_thread(submit)

    async def wait_loaded(self, app: str, timeout_s: float) -> None:
        """Until a replica is RUNNING (the first of several: the others keep starting); a failed start raises
        ModelLoadError with Serve's message."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self.state(app)
            if state.running >= 1 and state.deployment_status in _SERVING:
                return
            # The app's status, not the deployment's: right after a deploy the deployment can still show the old
            # version's status (UNHEALTHY after its replica's node died) until Serve's next control loop, while the
            # app already says DEPLOYING; a new version that fails makes the app DEPLOY_FAILED too.
            if state.app_status in _FAILED:
                raise ModelLoadError(_failure_message(state))
            if time.monotonic() > deadline:
                raise ModelTimeoutError(f"model app `{app}` did not start within {timeout_s:.0f} s")
            await asyncio.sleep(_POLL_S)

    async def new_replica_info(self, app: str, deployed_at: float, timeout_s: float) -> dict[str, Any]:
        """The info of the replica deployed at `deployed_at`, as soon as it answers: a call waits in the handle
        until Serve routes to the replica, which it does as the replica starts running, while polling Serve's
        status every `_POLL_S` (still watched here, for a failed start) saw it 0.2-0.5 s later. An answer from an
        older replica (one still up from before the deploy) is set aside for the status poll and a second call."""
        watch = asyncio.ensure_future(self.wait_loaded(app, timeout_s))
        ask = asyncio.ensure_future(self.info(app))
        try:
            done, _ = await asyncio.wait({watch, ask}, return_when=asyncio.FIRST_COMPLETED)  # watch: the deadline
            if ask in done and ask.exception() is None and ask.result().get("started_at", 0.0) >= deployed_at:
                return ask.result()
            await watch  # raises when the start failed or timed out
            return await self.info(app)
        finally:
            watch.cancel()
            ask.cancel()

    async def scale_to_zero(self, app: str, timeout_s: float) -> None:
        """The replica drains (in-flight requests finish) and exits; the app stays. Serve's external scaling API
        on the dashboard (see the module's docstring)."""
        url = f"{dashboard_url()}/api/v1/applications/{app}/deployments/{DEPLOYMENT}/scale"
        async with httpx.AsyncClient(timeout=30, headers=ray_private.dashboard_headers()) as client:
            response = await client.post(url, json={"target_num_replicas": 0})
        if response.status_code >= 300:
            raise ModelLoadError(f"scaling `{app}` to 0 failed: HTTP {response.status_code} {response.text}")
        deadline = time.monotonic() + timeout_s
        while (await self.state(app)).total > 0:  # draining replicas finish their requests first
            if time.monotonic() > deadline:
                raise ModelTimeoutError(f"model app `{app}` still has replicas after {timeout_s:.0f} s")
            await asyncio.sleep(_POLL_S)

    async def delete(self, app: str) -> None:
        await asyncio.to_thread(serve.delete, app, True)

    async def info(self, app: str) -> dict[str, Any]:
        return await _call_replica(app, "info")

    async def sleep(self, app: str) -> dict[str, Any]:
        return await _call_every_replica(app, "sleep")

    async def wake(self, app: str) -> dict[str, Any]:
        return await _call_every_replica(app, "wake")

    async def asleep(self, app: str) -> bool:
        """Whether the app's replicas are running and asleep (else a load deploys it afresh)."""
        state = await self.state(app)
        return state.running >= 1 and state.deployment_status in _SERVING and await self.replica_asleep(app)

    async def replica_asleep(self, app: str) -> bool:
        """Whether the app's running replica says it is asleep (unreachable counts as no)."""
        try:
            return bool((await self.info(app)).get("asleep"))
        except Exception:
            logger.warning("`%s`: its replica cannot say whether it sleeps; counted awake", app, exc_info=True)
            return False

    async def fits_now(self, spec: ModelSpec) -> bool:
        """Whether the cluster's free resources now hold one more replica of `spec` (what sleeping replicas still
        reserve counts as taken). Counted over the whole cluster: on several nodes a fit may still need one node."""
        import ray

        return not missing(replica_demand(spec.engine), ray.available_resources())

    async def after_load(self, app: str, deployed_at: float | None, spares: int) -> None:
        """Up to `spares` spare workers for the node of the app's new replica (`deployed_at`: None for an adopted
        deploy)."""
        if spares == 0:
            return
        worker = await _call_replica(app, "worker")
        await asyncio.sleep(SPARE_DELAY_S)
        if deployed_at is None:
            await asyncio.to_thread(self._spares.after_adopt, worker, spares)
        else:
            await asyncio.to_thread(self._spares.after_deploy, worker, deployed_at, spares)


ReplicaCall = Literal["info", "sleep", "wake", "worker"]


async def _call_replica(app: str, method: ReplicaCall) -> dict[str, Any]:
    """A call on one of the model's replicas; each answers the replica's info (`worker`: its worker's)."""
    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=app)
    result: dict[str, Any] = await getattr(handle, method).remote()
    return result


async def _call_every_replica(app: str, method: ReplicaCall) -> dict[str, Any]:
    """A call on every running replica at once (Serve's `broadcast`): the first one's info, with the memory all
    their processes hold and each one's pid. A replica that died meanwhile is left out (Serve replaces it)."""
    from ray.exceptions import RayActorError

    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=app)
    results = await handle.broadcast(method).results_async(return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException) and not isinstance(r, RayActorError)]
    if failed:
        raise failed[0]
    infos: list[dict[str, Any]] = [r for r in results if isinstance(r, dict)]
    if not infos:
        raise ModelLoadError(f"model app `{app}` has no running replica to {method}")
    held = [info.get("process_rss_bytes") for info in infos]
    total = sum(b for b in held if b is not None) if any(b is not None for b in held) else None
    return {**infos[0], "process_rss_bytes": total, "replica_pids": [info.get("pid") for info in infos]}
