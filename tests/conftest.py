"""Test session set-up: one real local Ray cluster with Serve on its own ports, and helpers to deploy routers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayrunner.runtime.warm_workers import CLUSTER_ENV

# Set before Ray is imported anywhere: no token auth, no usage stats (no network here), normal worker priority.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_worker_niceness", "0")
for _name, _value in CLUSTER_ENV.items():  # warm spare workers, as users get
    os.environ.setdefault(_name, _value)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")  # test_metrics waits for an export (default 10 s)
warnings.filterwarnings("ignore", category=DeprecationWarning)


def free_port() -> int:
    """A free port between Ray's worker ports (10002-19999) and the kernel's ephemeral range, which Ray's own
    processes draw from after this check."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)  # pytest -n: a range each
    low = 20000 + (worker % 4) * 2500
    for port in random.sample(range(low, low + 2500), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port found")


# The slow tier, marked here so no test has to remember it: everything in these folders (Serve over a cluster, or
# every architecture family on a model), and every test on the session's cluster. In-process tests that load a real
# model carry `@pytest.mark.slow` themselves. `bash scripts/test.sh --fast` runs the rest (`-m "not slow"`).
SLOW_FOLDERS = ("integration", "families")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        folder = item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""
        if folder in SLOW_FOLDERS or "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_models import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real local Ray cluster (dashboard on, for the scaling API) and Serve on a private HTTP port."""
    import ray
    from ray import serve

    env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "HF_HUB_OFFLINE")}
    if os.environ.get("RAYRUNNER_CACHE_DIR"):
        env["RAYRUNNER_CACHE_DIR"] = os.environ["RAYRUNNER_CACHE_DIR"]
    dashboard_port, http_port = free_port(), free_port()
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=True,
        dashboard_port=dashboard_port,
        runtime_env={"env_vars": env},
        logging_level="WARNING",
        log_to_driver=False,  # replica logs stay in Ray's files, not between pytest's dots
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, logging_config={"enable_access_log": False})
    yield {"http": f"http://127.0.0.1:{http_port}", "state_dir": tmp_path_factory.mktemp("registry")}
    serve.shutdown()
    ray.shutdown()


class Service:
    """A router (and its registry) deployed for one test module; torn down with every model app it made."""

    def __init__(self, cluster: dict[str, Any], config: dict[str, Any]) -> None:
        import httpx
        from ray import serve

        from rayrunner.router.app import build_router_app

        # Tests add models from temporary folders: every source is allowed unless a test sets `sources` itself.
        # Two spare workers: tests load models back to back, faster than one spare is replaced (~10 s of imports).
        self.config = {"sources": {"local_roots": ["/"], "hub_orgs": ["*"]}, "warm_spares": 2, **config}
        serve.run(build_router_app(self.config), name="rayrunner", route_prefix="/")
        self.cluster = cluster
        self.url = cluster["http"]
        self.http = httpx.Client(base_url=self.url, timeout=600)
        self.handle = serve.get_app_handle("rayrunner")
        assert self.http.get("/health").json() == {"status": "ok"}

    def chat(self, content: str, model: str = "default", **extra: Any) -> Any:
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return self.http.post("/v1/chat/completions", json=body)

    def card(self, model: str) -> dict[str, Any]:
        return self.http.get(f"/v1/models/{model}").json()

    def wait_loaded(self, model: str, timeout_s: float = 120) -> None:
        """Until `model` is loaded (a declared `load: true` model loads in the background after the deploy); a failed
        load fails at once with its error."""
        deadline = time.monotonic() + timeout_s
        while (card := self.card(model))["status"] != "loaded":
            assert card["status"] != "unloaded" or not card["last_error"], f"{model} failed: {card['last_error']}"
            assert time.monotonic() < deadline, f"{model} never loaded"
            time.sleep(0.2)

    def close(self) -> None:
        self.http.close()
        cleanup_serve()


def cleanup_serve() -> None:
    """Delete every app and the registry, so the next module starts from a clean Serve."""
    import ray
    from ray import serve

    from rayrunner.registry.actor import NAMESPACE, REGISTRY_NAME

    apps = list(serve.status().applications)
    for app in apps:  # all at once, then wait: deleting one by one takes ~1 s each
        serve.delete(app, _blocking=False)
    deadline = time.monotonic() + 60
    while set(apps) & set(serve.status().applications):
        assert time.monotonic() < deadline, f"apps not deleted: {list(serve.status().applications)}"
        time.sleep(0.1)
    for actor in ray.util.list_named_actors(all_namespaces=True):  # every service's registry
        if actor["namespace"] == NAMESPACE and actor["name"].startswith(REGISTRY_NAME):
            with contextlib.suppress(ValueError):  # gone meanwhile
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE))


def model_entry(model_id: str, source: str, load: bool = True, aliases: list[str] | None = None,
                **engine: Any) -> dict[str, Any]:
    spec = {"model_id": model_id, "which": {"type": "plain", "model_id": source}, "engine": engine}
    return {"spec": spec, "aliases": aliases or [], "load": load}


@pytest.fixture
def state_path(cluster: dict[str, Any], request: pytest.FixtureRequest) -> str:
    return str(Path(cluster["state_dir"]) / f"{request.node.name}.json")


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop for sequences driven by hand through a `StepScheduler` (their events are handed to it)."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The builtin SmolLM2's tokenizer (the tiny test models share it)."""
    from transformers import AutoTokenizer

    from rayrunner.models.sources import SMOLLM2, resolve

    return AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)
