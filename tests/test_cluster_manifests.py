"""The deployment files (cluster/ and serve_config.yaml), checked without a cluster: each parses, Ray accepts it
(Serve's config schema, the cluster launcher's schema), each app's args build what rayrunner builds from them, and
the KubeRay manifest gives every pod a GPU or the registry's state volume where the router's args expect them."""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import ray
import ray.autoscaler
import yaml
from ray.serve import Application
from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

from rayrunner.cli.config_check import http_host
from rayrunner.engines.vllm.runtime import PYTHON_ENV_VAR
from rayrunner.models.spec import ModelSpec
from rayrunner.registry.config import RegistryConfig

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
ROUTER_APP = "rayrunner.router.app:build_router_app"
MODEL_APP = "rayrunner.replica.model_server:build_model_app"
GPU = "nvidia.com/gpu"


def documents(path: Path) -> list[Any]:
    return list(yaml.safe_load_all(path.read_text()))


def rayservice() -> dict[str, Any]:
    (service,) = [doc for doc in documents(CLUSTER / "rayservice.yaml") if doc["kind"] == "RayService"]
    return service


def launcher() -> dict[str, Any]:
    (config,) = documents(CLUSTER / "cluster-launcher.yaml")
    return config


def serve_configs() -> dict[str, dict[str, Any]]:
    """Every serve config shipped: the files, and the one the RayService embeds."""
    files = (ROOT / "serve_config.yaml", ROOT / "serve_config.vllm.yaml", CLUSTER / "serve_config.gpu.yaml")
    configs = {path.name: documents(path)[0] for path in files}
    configs["rayservice.yaml serveConfigV2"] = yaml.safe_load(rayservice()["spec"]["serveConfigV2"])
    return configs


def router_args(config: dict[str, Any]) -> dict[str, Any]:
    (router,) = [app for app in config["applications"] if app["import_path"] == ROUTER_APP]
    args: dict[str, Any] = router["args"]
    return args


def pods(service: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each group's pod spec, by group name (`head` for the head group)."""
    cluster = service["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"]} | {group["groupName"]: group for group in cluster["workerGroupSpecs"]}
    return {name: group["template"]["spec"] for name, group in groups.items()}


def gpus(pod: dict[str, Any]) -> int:
    return sum(int(container["resources"].get("limits", {}).get(GPU, 0)) for container in pod["containers"])


def build(import_path: str, args: dict[str, Any]) -> Application:
    module, function = import_path.split(":")
    app: Application = getattr(importlib.import_module(module), function)(args)
    return app


@pytest.mark.parametrize("path", sorted([*CLUSTER.glob("*.yaml"), *CLUSTER.glob("*.yml"),
                                         *ROOT.glob("serve_config*.yaml")]), ids=lambda path: path.name)
def test_every_yaml_file_parses_to_mappings(path: Path) -> None:
    docs = documents(path)
    assert docs and all(isinstance(doc, dict) for doc in docs)


@pytest.mark.parametrize("name", sorted(serve_configs()))
def test_ray_serve_accepts_the_config_and_each_app_builds_what_rayrunner_builds(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PYTHON_ENV_VAR, sys.executable)  # vllm-backend apps build without vLLM's venv installed
    config = serve_configs()[name]
    ServeDeploySchema.model_validate(config)
    assert not _unknown_keys(config), "Serve ignores these keys without a word"
    registry = RegistryConfig.model_validate(router_args(config))
    declared = {entry.spec.model_id: entry.spec for entry in registry.models}
    apps = config["applications"]
    assert [app["route_prefix"] for app in apps if app["import_path"] == ROUTER_APP] == ["/"]
    for app in apps:
        assert isinstance(build(app["import_path"], app["args"]), Application)
        if app["import_path"] != MODEL_APP:
            continue
        spec = ModelSpec.model_validate(app["args"])
        # The registry unloads by scaling the app through Serve's external scaler, under the name it derives.
        assert app["external_scaler_enabled"] is True and app["route_prefix"] is None
        assert app["name"] == spec.app_name
        # A model app deployed with other args than the router registers is redeployed by the registry at start.
        assert spec == declared.get(spec.model_id), f"app `{app['name']}` and the router's spec differ"
    assert {app["import_path"] for app in apps} <= {ROUTER_APP, MODEL_APP}


def _unknown_keys(config: dict[str, Any]) -> set[str]:
    unknown = set(config) - set(ServeDeploySchema.model_fields)
    for app in config["applications"]:
        unknown |= set(app) - set(ServeApplicationSchema.model_fields)
    return unknown


@pytest.mark.parametrize("name", ["serve_config.gpu.yaml", "rayservice.yaml serveConfigV2"])
def test_multi_node_configs_keep_the_registry_state_on_shared_storage(name: str) -> None:
    config = serve_configs()[name]
    state_path = PurePosixPath(router_args(config)["state_path"])
    assert state_path.is_absolute() and state_path.is_relative_to("/shared")
    assert config["proxy_location"] == "EveryNode"
    engines = [entry.spec.engine for entry in RegistryConfig.model_validate(router_args(config)).models]
    assert any(engine.num_gpus > 0 for engine in engines)
    # A replica that reserved no GPU still sees a GPU node's GPUs, and `device: auto` would load onto one.
    assert all(engine.device == "cpu" for engine in engines if engine.num_gpus == 0)


@pytest.mark.parametrize("name", sorted(serve_configs()))
def test_no_shipped_config_serves_open_beyond_loopback(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router refuses to start with no key on a host other machines reach (unless `auth.allow_open`): the
    RayService, whose pods must bind every interface, gives every pod the keys from its Secret."""
    for variable in ("RAYRUNNER_API_KEYS", "RAYRUNNER_ADMIN_API_KEYS"):
        monkeypatch.delenv(variable, raising=False)
    config = serve_configs()[name]
    if name.startswith("rayservice.yaml"):
        assert http_host(config) == "0.0.0.0"
        for group, pod in pods(rayservice()).items():
            env = {var["name"]: var for container in pod["containers"] for var in container.get("env", [])}
            secret = env["RAYRUNNER_ADMIN_API_KEYS"]["valueFrom"]["secretKeyRef"]
            assert secret["name"] == "rayrunner-api-keys", f"`{group}` pods have no admin keys"
        monkeypatch.setenv("RAYRUNNER_ADMIN_API_KEYS", "from-the-secret")
    auth = RegistryConfig.model_validate(router_args(config)).auth
    assert not auth.allow_open
    auth.check_http_host(http_host(config))


def test_the_head_script_keeps_the_dashboard_on_loopback() -> None:
    """Whoever reaches Ray's dashboard can submit jobs; the registry actor that scales models through it runs on
    the head, so loopback is enough."""
    start = (CLUSTER / "start-head.sh").read_text().split("\nexec ", 1)[1]
    assert "--dashboard-host=127.0.0.1" in start and "0.0.0.0" not in start


def test_rayservice_has_a_cpu_head_and_a_gpu_worker_group_on_rayrunners_ray() -> None:
    service = rayservice()
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"].rsplit(".", 1)[0] == ray.__version__.rsplit(".", 1)[0]
    by_group = pods(service)
    assert gpus(by_group.pop("head")) == 0
    assert any(gpus(pod) >= 1 for pod in by_group.values())
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        # KubeRay's rayStartParams is a map of strings; an extended resource's request must equal its limit.
        assert all(isinstance(value, str) for value in group["rayStartParams"].values())
        for container in group["template"]["spec"]["containers"]:
            limits, requests = container["resources"]["limits"], container["resources"].get("requests", {})
            assert requests.get(GPU, limits.get(GPU)) == limits.get(GPU)
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"  # rayrunner scales models through it
    ports = {port["containerPort"] for container in head["template"]["spec"]["containers"]
             for port in container["ports"]}
    assert {8265, 8000, 8080} <= ports


def test_each_model_replica_fits_on_a_gpu_worker_pod() -> None:
    service = rayservice()
    workers = [pod for name, pod in pods(service).items() if name != "head" and gpus(pod)]
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    for app in config["applications"]:
        if app["import_path"] == MODEL_APP:
            engine = ModelSpec.model_validate(app["args"]).engine
            assert any(engine.num_gpus <= gpus(pod) and engine.num_cpus <= _cpus(pod) for pod in workers)


def _cpus(pod: dict[str, Any]) -> float:
    return sum(float(container["resources"]["limits"]["cpu"]) for container in pod["containers"])


def test_every_rayservice_pod_mounts_the_claim_that_holds_the_state_file() -> None:
    claims = [doc for doc in documents(CLUSTER / "rayservice.yaml") if doc["kind"] == "PersistentVolumeClaim"]
    assert [claim["spec"]["accessModes"] for claim in claims] == [["ReadWriteMany"]]  # every pod mounts it at once
    state_path = PurePosixPath(router_args(yaml.safe_load(rayservice()["spec"]["serveConfigV2"]))["state_path"])
    for name, pod in pods(rayservice()).items():
        volumes = {volume["name"] for volume in pod["volumes"]
                   if volume.get("persistentVolumeClaim", {}).get("claimName") == claims[0]["metadata"]["name"]}
        mounts = [mount["mountPath"] for container in pod["containers"] for mount in container.get("volumeMounts", [])
                  if mount["name"] in volumes]
        assert any(state_path.is_relative_to(mount) for mount in mounts), f"`{name}` pods cannot reach {state_path}"


def test_ray_accepts_the_cluster_launcher_config() -> None:
    config = launcher()
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    from ray.autoscaler._private.commands import prepare_config
    from ray.autoscaler._private.util import validate_config

    validate_config(prepare_config(config))  # with the provider's defaults filled in, as `ray up` checks it
    assert config["head_node_type"] in config["available_node_types"]


def test_cluster_launcher_installs_rayrunner_and_deploys_a_config_with_its_state_on_the_shared_mount() -> None:
    config = launcher()
    assert Path(config["file_mounts"]["~/rayrunner"]) == Path(".")  # `ray up` runs from the repository root
    assert any("scripts/install.sh" in command for command in config["setup_commands"])
    assert any(re.search(r"mount .* /shared\b", command) for command in config["setup_commands"])
    (deploy,) = [command for command in config["head_start_ray_commands"] if command.startswith("serve deploy")]
    deployed = ROOT / deploy.split()[-1].removeprefix("~/rayrunner/")
    state_path = PurePosixPath(router_args(documents(deployed)[0])["state_path"])
    assert state_path.is_relative_to("/shared")
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all((ROOT / script).is_file() for script in re.findall(r"~/rayrunner/(cluster/\S+\.sh)", " ".join(starts)))
