"""Capacity on a real cluster, where use is reported by routers and a stream holds its replica: with
`max_loaded_models: 2`, a third model evicts the least recently used idle one (its card says why), a request for an
evicted model reloads it, and a model busy with a stream is not evicted until the stream ends while a pinned one
never is. Tiny random models; the tests run in order, each starting from the state the last left. The decisions
themselves (pinning, keep_alive, bytes) run in process: tests/test_registry_lifecycle.py, test_capacity_logic.py;
a keep_alive over HTTP: integration/test_lifecycle.py."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Service, model_entry

REPORT_WAIT_S = 1.5  # routers report use in batches of about half a second


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {
        "models": [
            model_entry("m1", tiny_llama_dir),
            model_entry("m2", tiny_llama_dir),
            {**model_entry("m3", tiny_llama_dir, load=False), "pinned": True},
        ],
        "max_loaded_models": 2,
        "state_path": str(cluster["state_dir"] / "capacity.json"),
    }
    svc = Service(cluster, config)
    yield svc
    svc.close()


def use(service: Service, *models: str, **extra: Any) -> None:
    """One short chat per model, in order (the last is the most recently used), then let the use be reported."""
    for model in models:
        response = service.chat("hi", model=model, max_tokens=2, **extra)
        assert response.status_code == 200, response.text
    time.sleep(REPORT_WAIT_S)


def loaded(service: Service) -> set[str]:
    return {m["id"] for m in service.http.get("/v1/models").json()["data"] if m["status"] == "loaded"}


def wait_for(check: Any, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_a_third_model_evicts_the_least_recently_used(service: Service) -> None:
    wait_for(lambda: loaded(service) == {"m1", "m2"}, 120)
    use(service, "m2", "m1")
    use(service, "m3")
    assert loaded(service) == {"m1", "m3"}
    card = service.card("m2")
    assert card["status"] == "unloaded" and card["unloaded_reason"] == "evicted: max_loaded_models"
    assert card["last_used_at"] is not None and card["pinned"] is False
    assert service.card("m3")["unloaded_reason"] is None and service.card("m3")["load_seconds"] > 0


def test_a_request_for_an_evicted_model_reloads_it(service: Service) -> None:
    use(service, "m2")  # m1 was used before m3: it goes
    assert loaded(service) == {"m2", "m3"}
    assert service.card("m1")["unloaded_reason"] == "evicted: max_loaded_models"
    assert service.card("m2")["unloaded_reason"] is None


def test_a_model_streaming_is_not_evicted_mid_stream(service: Service) -> None:
    body = {"model": "m2", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "stream": True,
            "stop": []}
    lines: list[str] = []
    ended: dict[str, float] = {}

    def consume() -> None:
        with service.http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines.extend(response.iter_lines())
        ended["stream"] = time.monotonic()

    reader = threading.Thread(target=consume)
    reader.start()
    wait_for(lambda: service.card("m2")["in_flight"] > 0)
    waiting = threading.Thread(target=lambda: ended.update(
        m1=time.monotonic() if service.chat("hi", model="m1", max_tokens=2).status_code == 200 else -1.0))
    waiting.start()  # m3 is pinned and m2 busy: the load of m1 waits for room
    asked = time.monotonic()
    while reader.is_alive():  # loaded while its stream is open (the client may still read the end it was sent)
        card = service.card("m2")
        assert card["status"] == "loaded" or card["in_flight"] == 0
        time.sleep(0.1)
    waiting.join()
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and '"finish_reason"' in data[-2] and "error" not in data[-2]
    assert asked < ended["stream"] < ended["m1"]
    assert loaded(service) == {"m1", "m3"}
    assert service.card("m2")["unloaded_reason"] == "evicted: max_loaded_models"


def test_the_registry_logs_each_eviction_and_why_and_each_load_and_how(service: Service) -> None:
    log = (service.cluster["state_dir"] / "capacity.log").read_text()
    assert "unloading `m2` (evicted: max_loaded_models, sleep)" in log
    assert "unloading `m1` (evicted: max_loaded_models, sleep)" in log
    assert re.search(r"loaded `m3` \(started, [0-9.]+ s\)", log)  # its first load started a replica
    assert re.search(r"loaded `m2` \(woken, [0-9.]+ s\)", log)  # back from sleep
