"""rayrunner served over HTTP for the benchmarks that drive it from outside: a local cluster (`bench_cluster`), the
router with the builtin SmolLM2 (and any other models given) deployed with their shipped engine settings, and models
added at runtime through the admin API as a user would.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from rayrunner.models.sources import SMOLLM2

BASE_ID = "smollm2"
LOAD_TIMEOUT_S = 900.0


def smollm2_spec(model_id: str = BASE_ID, isq: str | None = None) -> dict[str, Any]:
    """A spec of the builtin bf16 SmolLM2 under `model_id`, quantized in situ to `isq` when given."""
    spec: dict[str, Any] = {"model_id": model_id, "which": {"type": "plain", "model_id": SMOLLM2}}
    if isq is not None:
        spec["in_situ_quant"] = isq
    return spec


@contextmanager
def rayrunner_service(specs: list[dict[str, Any]]) -> Iterator[str]:
    """A fresh cluster serving `specs` (all loaded, the first the default); yields the HTTP base URL and shuts the
    cluster down on exit."""
    import ray
    from bench_cluster import start_cluster
    from ray import serve

    from rayrunner.router.app import build_router_app

    base = start_cluster()
    try:
        with tempfile.TemporaryDirectory(prefix="rayrunner-bench-") as state_dir, \
                httpx.Client(base_url=base, timeout=LOAD_TIMEOUT_S) as http:
            config = {"models": [{"spec": spec, "load": True} for spec in specs],
                      "state_path": str(Path(state_dir) / "registry.json")}
            serve.run(build_router_app(config), name="rayrunner", route_prefix="/",
                      logging_config={"enable_access_log": False})
            for spec in specs:
                wait_loaded(http, spec["model_id"])
            yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def add_model(http: httpx.Client, spec: dict[str, Any]) -> None:
    """Add `spec` through `POST /v1/models/add` and wait until it is loaded."""
    response = http.post("/v1/models/add", json={**spec, "load": True})
    if response.status_code != 201:
        raise RuntimeError(f"adding {spec['model_id']}: HTTP {response.status_code} {response.text}")
    wait_loaded(http, spec["model_id"])


def wait_loaded(http: httpx.Client, model_id: str) -> None:
    """Poll the model's status until it is `loaded`; a `failed` load raises with the registry's `last_error`."""
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while (status := http.post("/v1/models/status", json={"model_id": model_id}).json()).get("status") != "loaded":
        if status.get("status") == "failed":
            raise RuntimeError(f"{model_id} failed to load: {status.get('last_error') or status}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model_id} did not load within {LOAD_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


async def stream_chunks(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of one streamed OpenAI response (its `data: {...}` lines) as they arrive; a status other than
    200 raises `RuntimeError` naming the model and the body."""
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{body.get('model')}: HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])
