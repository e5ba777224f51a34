"""Every use of Ray's private or experimental APIs, in one place, each for something Ray offers no public API for.
`tests/test_ray_private.py` checks that each still exists with the shape used here, so a Ray upgrade that moves
one fails there by name, not somewhere inside a replica.
"""

from __future__ import annotations

from typing import Any, cast

# The variable through which Ray hands a worker its `worker_process_setup_hook` (a function's import path), which
# Ray runs in the worker's main thread before its first task. Ray converts the runtime_env field to it only for a
# job's runtime_env (`ray.init`); set here directly, it works for one actor's (a model replica's) as well.
SETUP_HOOK_ENV_VAR = "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"


def read_ray_address() -> str | None:
    """The address of the cluster `ray start` left on this machine (what `address="auto"` would find), or None.
    The `Runner` joins only that one or `RAY_ADDRESS`, never another process's private cluster."""
    from ray._private.utils import read_ray_address as read

    address: str | None = read()
    return address


def dashboard_url() -> str | None:
    """The address the cluster published for its dashboard (Serve's scaling REST API lives there)."""
    from ray._private.services import get_webui_url_from_internal_kv

    url: str | None = get_webui_url_from_internal_kv()
    return url


def dashboard_headers() -> dict[str, str]:
    """The `authorization` header Ray's dashboard needs under its token auth (`RAY_AUTH_MODE=token`), else none."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    headers: dict[str, str] = get_auth_headers_if_auth_enabled({})
    return headers


async def serve_http_host() -> str | None:
    """The host Serve's HTTP proxies bind (`http_options.host` as Serve's controller holds it); None: no proxy."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    host: str | None = (await controller.get_http_config.remote()).host
    return host


def grpc_channel(address: str) -> Any:
    """A gRPC channel to a raylet, set up as Ray's own clients set theirs up (to ask it to prestart a worker)."""
    from ray._private.grpc_utils import init_grpc_channel

    return init_grpc_channel(address)


def cluster_config() -> Any:
    """The autoscaler's cluster config (node types and their resources), or None without an autoscaler."""
    from ray._private.state import state

    return state.get_cluster_config()


def internal_kv() -> Any:
    """Ray's internal key-value store (the GCS) when this process is connected to a cluster, else None."""
    from ray.experimental import internal_kv as kv

    return kv if kv._internal_kv_initialized() else None


def kv_get(key: str, namespace: str) -> bytes | None:
    kv = internal_kv()
    value: bytes | None = kv._internal_kv_get(key, namespace=namespace) if kv is not None else None
    return value


def kv_put(key: str, value: str, namespace: str) -> None:
    kv = internal_kv()
    if kv is not None:
        kv._internal_kv_put(key, value, True, namespace=namespace)


def kv_delete(key: str, namespace: str) -> None:
    kv = internal_kv()
    if kv is not None:
        kv._internal_kv_del(key, namespace=namespace)


# The resource only the head node has: the registry actor is placed there (it outlives every worker node).
HEAD_NODE_RESOURCE = "node:__internal_head__"


def serve_request_id() -> str | None:
    """The id Serve gave the request this replica is serving (what the router saw), or None outside a request."""
    from ray.serve.context import _get_serve_request_context

    request_id: str | None = _get_serve_request_context()._internal_request_id or None
    return request_id


def with_code_version(deployment: Any, version: str) -> Any:
    """`deployment` deployed as code version `version`: Serve's own field, which its public API no longer lets
    callers set (a rescale deployed as the running version restarts no replica)."""
    return deployment.options(version=version, _internal=True)


def prestart_workers(address: str, job_id: str, serialized_runtime_env: str, keep_alive_s: int, count: int) -> None:
    """Ask the raylet at `address` to start `count` idle workers of that job and runtime env (Ray's own
    `PrestartWorkers` call, which no public API offers)."""
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc, runtime_environment_pb2

    common, manager, runtime_env = cast(Any, (common_pb2, node_manager_pb2, runtime_environment_pb2))  # no stubs
    channel = grpc_channel(address)
    try:
        request = manager.PrestartWorkersRequest(
            language=common.PYTHON, job_id=bytes.fromhex(job_id),
            runtime_env_info=runtime_env.RuntimeEnvInfo(serialized_runtime_env=serialized_runtime_env),
            keep_alive_duration_secs=keep_alive_s, num_workers=count)
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()
