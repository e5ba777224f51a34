"""Unload by sleep on a real cluster: the replica process stays with its weights freed, the card says so, and a
request or a reload wakes the same process; a sleeping model can still be stopped."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from ray import serve

from rayrunner.models.spec import model_app_name
from rayrunner.replica.model_server import DEPLOYMENT
from rayrunner.runtime.cache_dir import cache_dir
from rayrunner.runtime.warm_workers import SPARE_DELAY_S
from tests.conftest import Service, model_entry


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {"models": [model_entry("napper", tiny_llama_dir)], "state_path": str(cluster["state_dir"] / "sleep.json")}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def unload(service: Service, mode: str) -> Any:
    return service.http.post("/v1/models/unload", json={"model_id": "napper", "mode": mode})


def test_sleep_keeps_the_process_and_a_request_wakes_it(service: Service) -> None:
    first = service.chat("hi", model="napper", max_tokens=5).json()["choices"][0]["message"]["content"]
    awake = service.card("napper")
    pid = awake_pid(service, awake)
    answer = unload(service, "sleep")
    assert answer.status_code == 200 and answer.json() == {"model_id": "napper", "status": "unloaded",
                                                           "unload_mode": "sleep"}
    card = service.card("napper")
    assert card["unload_mode"] == "sleep" and card["unloaded_reason"] == "user" and card["held_bytes"] > 0
    assert card["weight_bytes"] is None
    reply = service.chat("hi", model="napper", max_tokens=5)  # wakes it
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == first
    card = service.card("napper")
    assert card["status"] == "loaded" and card["weight_bytes"] == awake["weight_bytes"]
    assert awake_pid(service, card) == pid  # the same replica process, woken


def awake_pid(service: Service, card: dict[str, Any]) -> int:
    return int(service.handle.model_card.remote(card["id"]).result()["info"]["pid"])


def test_reload_wakes_and_stop_ends_a_sleeping_model(service: Service) -> None:
    pid = awake_pid(service, service.card("napper"))
    assert unload(service, "sleep").status_code == 200
    assert unload(service, "sleep").status_code == 409  # already unloaded
    assert service.http.post("/v1/models/reload", json={"model_id": "napper"}).status_code == 200
    assert awake_pid(service, service.card("napper")) == pid  # the same process, woken
    assert unload(service, "sleep").status_code == 200
    parked = cache_dir() / "parked" / f"{socket.gethostname()}-{pid}-napper.safetensors"
    assert parked.is_file()  # the weights wait on disk (rayrunner.engines.parked_weights)
    stopped = unload(service, "stop")  # a sleeping model may still be stopped: its replica goes
    assert stopped.status_code == 200 and stopped.json() == {"model_id": "napper", "status": "unloaded"}
    assert service.card("napper")["unload_mode"] == "stop" and service.card("napper")["held_bytes"] is None
    assert not parked.exists()  # removed as the replica shut down
    assert service.chat("hi", model="napper", max_tokens=3).status_code == 200  # a fresh replica
    assert awake_pid(service, service.card("napper")) != pid


def test_bad_mode_is_a_400(service: Service) -> None:
    answer = unload(service, "hibernate")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mode"


def test_the_wake_up_is_in_the_replica_log(service: Service) -> None:
    """rayrunner's own INFO lines land in the replica's Serve log (Serve writes only `ray.serve` there by itself)."""
    import ray

    assert service.chat("hi", model="napper", max_tokens=2).status_code == 200  # loaded (a stopped model reloads)
    assert unload(service, "sleep").status_code == 200
    assert service.chat("hi", model="napper", max_tokens=2).status_code == 200  # wakes it
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    text = "".join(path.read_text() for path in logs.glob("replica_napper_*.log"))
    assert "woke up in" in text


def test_a_stopped_model_loads_again_in_a_waiting_worker(service: Service) -> None:
    """After each deploy the registry has the node start a spare worker (rayrunner.runtime.warm_workers): the next
    replica of a stopped model runs in it, a process older than the reload, instead of starting one."""
    for _ in range(2):  # the first deploy here may start cold; it leaves a spare behind for the second
        if service.card("napper")["status"] == "loaded":
            time.sleep(SPARE_DELAY_S + 1)  # the spare is asked for this long after the load
            assert unload(service, "stop").status_code == 200
        running_before = set(psutil.pids())  # by pid: a young spare's start time is within psutil's 1 s error
        assert service.http.post("/v1/models/reload", json={"model_id": "napper"}).status_code == 200
    replica = serve.get_deployment_handle(DEPLOYMENT, app_name=model_app_name("napper"))
    assert replica.info.remote().result()["pid"] in running_before
    assert service.chat("hi", model="napper", max_tokens=3).status_code == 200
