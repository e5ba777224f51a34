"""Ray's private APIs that rayrunner uses (`rayrunner.runtime.ray_private`) still exist with the shape it uses: a Ray
upgrade that moves one fails here, by name."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

from rayrunner.runtime import ray_private


def test_the_private_functions_exist_with_the_arguments_used() -> None:
    from ray._private.grpc_utils import init_grpc_channel
    from ray._private.services import get_webui_url_from_internal_kv
    from ray._private.state import state
    from ray._private.utils import read_ray_address
    from ray.experimental import internal_kv

    assert not inspect.signature(read_ray_address).parameters or all(
        p.default is not inspect.Parameter.empty for p in inspect.signature(read_ray_address).parameters.values())
    assert not inspect.signature(get_webui_url_from_internal_kv).parameters
    assert "address" in inspect.signature(init_grpc_channel).parameters
    assert callable(state.get_cluster_config)
    for name, argument in (("_internal_kv_get", "namespace"), ("_internal_kv_put", "namespace"),
                           ("_internal_kv_del", "namespace")):
        assert argument in inspect.signature(getattr(internal_kv, name)).parameters
    assert callable(internal_kv._internal_kv_initialized)


def test_without_a_cluster_the_kv_is_absent_and_reads_nothing() -> None:
    assert ray_private.internal_kv() is None or ray_private.kv_get("rayrunner-test-missing", "rayrunner") is None
    ray_private.kv_put("rayrunner-test", "x", "rayrunner")  # no cluster: a no-op, not an error
    ray_private.kv_delete("rayrunner-test", "rayrunner")


def test_the_raylet_prestart_request_still_has_the_fields_used() -> None:
    from ray.core.generated import node_manager_pb2, node_manager_pb2_grpc

    fields = set(node_manager_pb2.PrestartWorkersRequest.DESCRIPTOR.fields_by_name)
    assert {"language", "job_id", "runtime_env_info", "keep_alive_duration_secs", "num_workers"} <= fields
    assert hasattr(node_manager_pb2_grpc.NodeManagerServiceStub, "__init__")


def test_a_deployment_still_takes_its_code_version_internally() -> None:
    """`model_deployment` deploys a rescale as the running version: `options(version=..., _internal=True)`."""
    from ray import serve

    deployment = ray_private.with_code_version(serve.deployment(name="d")(lambda: None), "v1")
    assert deployment.version == "v1"


def test_outside_a_request_serve_has_no_request_id() -> None:
    """`serve_request_id` reads Serve's request context (`_internal_request_id`), empty outside a request."""
    from ray.serve.context import _get_serve_request_context

    assert hasattr(_get_serve_request_context(), "_internal_request_id")
    assert ray_private.serve_request_id() is None


def test_no_other_module_uses_rays_private_apis() -> None:
    private = re.compile(r"ray\._private|ray\.core\.generated|ray\.experimental|serve\._private|_internal=True|"
                         r"__internal_head__|_get_serve_request_context")
    package = Path(ray_private.__file__).parents[1]
    users = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
             if path.name != "ray_private.py" and private.search(path.read_text())]
    assert users == []


def test_serves_controller_and_the_dashboards_token_header_are_where_they_were() -> None:
    """`serve_http_host` asks Serve's controller (by name) for its HTTP options; `dashboard_headers` asks Ray."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    from ray.serve._private.controller import ServeController
    from ray.serve.config import HTTPOptions

    assert SERVE_CONTROLLER_NAME and SERVE_NAMESPACE
    # (Ray adds `_ray_trace_ctx` to an actor class's methods once the class has been made an actor in this process)
    assert not inspect.signature(ServeController.get_http_config).parameters.keys() - {"self", "_ray_trace_ctx"}
    assert "host" in HTTPOptions.model_fields
    assert list(inspect.signature(get_auth_headers_if_auth_enabled).parameters) == ["user_headers"]


def test_under_token_auth_the_dashboard_header_carries_rays_token(tmp_path: Path) -> None:
    """In a fresh interpreter (Ray reads the auth mode once), with a home of its own (no token file is left)."""
    code = "from rayrunner.runtime import ray_private; print(ray_private.dashboard_headers())"
    env = {**os.environ, "HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "t" * 32}
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert ran.stdout.strip() == repr({"authorization": f"Bearer {'t' * 32}"}), ran.stderr
    assert ray_private.dashboard_headers() == {}  # this process: RAY_AUTH_MODE=disabled


def test_the_setup_hook_variable_is_the_one_ray_workers_read() -> None:
    from ray._private import ray_constants
    from ray._private.workers import default_worker

    assert ray_private.SETUP_HOOK_ENV_VAR == ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    assert "WORKER_PROCESS_SETUP_HOOK_ENV_VAR" in inspect.getsource(default_worker)
