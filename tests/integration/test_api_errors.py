"""Failures as a client sees them over real HTTP: a replica killed mid-stream gives a short, stable, retryable error
with none of Ray's internals (node IP, pid, actor id), and the model answers again once Serve has replaced it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Service, model_entry

MODEL = "victim"


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {"models": [model_entry(MODEL, tiny_llama_dir)], "state_path": str(cluster["state_dir"] / "errors.json")}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def replica_pid(model: str) -> int:
    """The pid of the model's current replica (asked of the replica itself: after a restart the card is stale)."""
    from ray import serve

    from rayrunner.deployments.model_server import DEPLOYMENT
    from rayrunner.spec import model_app_name

    return int(serve.get_deployment_handle(DEPLOYMENT, app_name=model_app_name(model)).info.remote().result()["pid"])


def test_replica_killed_mid_stream_gives_a_stable_error(service: Service) -> None:
    assert service.chat("hello", model=MODEL, max_tokens=2).status_code == 200  # loaded and warm
    pid = replica_pid(MODEL)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1500,
            "stream": True}
    events: list[str] = []
    with service.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 3:
                os.kill(pid, signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error == {"message": f"model `{MODEL}` is unavailable right now; retry", "type": "server_error",
                     "param": None, "code": "model_unavailable"}
    assert str(pid) not in events[-2] and "actor" not in events[-2].lower() and "127.0.0.1" not in events[-2]

    deadline = time.monotonic() + 180  # Serve replaces the dead replica; requests then succeed again
    while (retry := service.chat("hello", model=MODEL, max_tokens=2)).status_code != 200:
        assert time.monotonic() < deadline, retry.text
        assert retry.json()["error"]["code"] == "model_unavailable"
        time.sleep(1)
    assert replica_pid(MODEL) != pid
