"""Metrics on Ray's own Prometheus endpoint, labelled by model, after real traffic and an unload/reload."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import Service, model_entry

EXPECTED = [
    'ray_rayrunner_model_status{.*model="tiny".*status="loaded".*} 1',
    'ray_rayrunner_model_phase{.*model="tiny".*phase="loaded".*} 1',
    'ray_rayrunner_model_loads_total{.*model="tiny".*result="ok".*}',
    'ray_rayrunner_model_unloads_total{.*model="tiny".*reason="user".*}',
    'ray_rayrunner_model_load_seconds_bucket{.*model="tiny".*}',
    'ray_rayrunner_model_weight_bytes{.*model="tiny".*}',
    'ray_rayrunner_requests_total{.*model="tiny".*route="chat".*status="200".*}',
    'ray_rayrunner_requests_total{.*model="tiny".*route="chat_stream".*status="200".*}',
    'ray_rayrunner_requests_total{.*model="unknown".*route="chat".*status="404".*}',
    'ray_rayrunner_time_to_first_token_seconds_bucket{.*model="tiny".*}',
    'ray_rayrunner_inter_token_latency_seconds_bucket{.*model="tiny".*}',
    'ray_rayrunner_prompt_tokens_total{.*model="tiny".*}',
    'ray_rayrunner_completion_tokens_total{.*model="tiny".*}',
    'ray_rayrunner_running_sequences{.*model="tiny".*}',
    'ray_rayrunner_queued_requests{.*model="tiny".*}',
    'ray_rayrunner_kv_cache_bytes{.*model="tiny".*}',
    'ray_rayrunner_kv_cache_budget_bytes{.*model="tiny".*}',
    'ray_rayrunner_replica_sequences{.*model="tiny".*replica="[a-z0-9]+".*}',
    'ray_rayrunner_model_replicas{.*model="tiny".*state="target".*} 1',
]


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {"models": [model_entry("tiny", tiny_llama_dir)],
              "state_path": str(cluster["state_dir"] / "metrics.json")}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def scrape() -> str:
    import ray

    texts = []
    for node in ray.nodes():
        if node["Alive"]:
            url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
            texts.append(httpx.get(url, timeout=10).text)
    return "\n".join(texts)


def test_metrics_appear_labelled_by_model(service: Service) -> None:
    for stream in (False, True, False):
        assert service.chat("hello", model="tiny", max_tokens=8, stream=stream).status_code == 200
    assert service.chat("hello", model="no-such-model").status_code == 404
    assert service.http.post("/v1/models/unload", json={"model_id": "tiny", "mode": "sleep"}).status_code == 200
    assert service.http.post("/v1/models/reload", json={"model_id": "tiny"}).status_code == 200
    assert service.chat("again", model="tiny", max_tokens=8).status_code == 200

    deadline = time.monotonic() + 120  # the metrics agent exports every few seconds
    missing = EXPECTED
    while missing:
        text = scrape()
        missing = [pattern for pattern in EXPECTED if not re.search(pattern, text)]
        assert time.monotonic() < deadline, f"never exported: {missing}"
        time.sleep(2)

    time.sleep(3 * 2)  # three report intervals: Ray's agent alone would have dropped a gauge set once by now
    gauges = [pattern for pattern in EXPECTED if "status=" in pattern or "sequences" in pattern or "queued" in pattern
              or "weight_bytes" in pattern or "kv_cache" in pattern]
    assert [pattern for pattern in gauges if not re.search(pattern, scrape())] == []
