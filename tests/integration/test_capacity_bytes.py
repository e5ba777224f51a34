"""`max_loaded_bytes` on a real cluster: a load that would pass it evicts an idle model (card: `evicted:
max_loaded_bytes`), and a model too large to fit alone is a 400 before anything loads. Tiny random models; the
tests run in order. A load with only pinned models in the way waits, then fails with `capacity_exhausted`: in
process, tests/test_registry_lifecycle.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rayrunner.models.footprint import estimate_bytes
from rayrunner.models.spec import build_spec
from tests.conftest import Service, model_entry

KV = 1 << 20  # each tiny model's KV budget: small, so SmolLM2 with its default one is far past the limit


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    tiny = build_spec("t", {"type": "plain", "model_id": tiny_llama_dir}, engine={"kv_cache_bytes": KV})
    one_model = estimate_bytes(tiny)
    assert one_model is not None
    config = {
        "models": [model_entry("t1", tiny_llama_dir, kv_cache_bytes=KV),
                   model_entry("t2", tiny_llama_dir, load=False, kv_cache_bytes=KV)],
        "max_loaded_bytes": int(one_model * 1.5),
        "state_path": str(cluster["state_dir"] / "capacity_bytes.json"),
    }
    svc = Service(cluster, config)
    yield svc
    svc.close()


def test_a_load_past_the_bytes_limit_evicts_an_idle_model(service: Service) -> None:
    service.wait_loaded("t1")
    assert service.card("t1")["estimated_bytes"] > 0
    assert service.chat("hi", model="t2", max_tokens=2).status_code == 200
    card = service.card("t1")
    assert card["status"] == "unloaded" and card["unloaded_reason"] == "evicted: max_loaded_bytes"


def test_a_model_too_large_to_fit_alone_is_a_400(service: Service) -> None:
    which = {"type": "plain", "model_id": "smollm2-135m-instruct"}
    response = service.http.post("/v1/models/add", json={"model_id": "big", "which": which})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "model_too_large"
    assert service.card("big")["status"] == "unloaded"
    assert service.card("t2")["status"] == "loaded"
