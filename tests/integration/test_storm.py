"""A request storm (CI size) on a real cluster: 8 clients for 20 s mixing chat, streamed chat, completions and
embeddings on two tiny text models and the builtin embedding model, while a driver unloads, reloads, switches the
default, adds and removes a model every 2 s. Every request ends 200 or a documented 4xx/503, every stream ends with
`[DONE]`, no model is left `reloading`, and the registry agrees with Serve's replica counts. The full-size storm is
`python -m tests.stress.storm`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Service
from tests.stress.storm_core import Models, Storm, settle, storm_config, summary

CLIENTS, DURATION_S, OP_INTERVAL_S = 8, 20.0, 2.0


@pytest.fixture(scope="module")
def storm_service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[tuple[Service, Models]]:
    config, models = storm_config(tiny_llama_dir, str(cluster["state_dir"] / "storm.json"))
    svc = Service(cluster, config)
    yield svc, models
    svc.close()


def test_storm_of_requests_and_lifecycle_changes(storm_service: tuple[Service, Models]) -> None:
    service, models = storm_service
    assert settle(service.http, check_serve=True, timeout_s=120) == []  # declared models up, Serve agrees
    storm = Storm(service.url, models, CLIENTS, DURATION_S, OP_INTERVAL_S)
    tally = storm.run()
    print(summary(tally, storm.elapsed_s))
    assert tally.problems == []
    kinds = {label.split()[0] for label, _ in tally.requests.items() if " 200" in label}
    assert kinds == {"chat", "chat_stream", "completion", "embedding"}  # each kind was served, not only refused
    operations = {label for label in tally.operations if label.split()[1] in ("200", "201")}
    assert {op.split()[0] for op in operations} >= {"unload", "default", "add", "remove"}
    # A reload races the clients' requests, which reload an unloaded model themselves: on a slow box every reload
    # may find its model loaded again already (409), which is as right an answer
    assert {"reload 200", "reload 409 model_already_loaded"} & set(tally.operations)
    assert settle(service.http, check_serve=True) == []
    target = models.text[0]
    # The storm's last operation may have left it unloaded: a request loads it, then each operation, without a race,
    # succeeds
    assert service.chat("before the checks", model=target, max_tokens=2).status_code == 200
    for operation in ("unload", "reload"):
        response = service.http.post(f"/v1/models/{operation}", json={"model_id": target})
        assert response.status_code == 200, response.text
    after = service.chat("after the storm", model="sa", max_tokens=2)
    assert after.status_code == 200, after.text
