"""A model on several replicas, on a real cluster: a fixed `num_replicas: 2` shares the load, a request goes to the
replica with fewer sequences, and the model goes down and up whole (stop, sleep, reload); `routing: prefix` keeps a
user on one replica; a replica killed under load loses no request; an autoscaled model grows under streams and
shrinks when idle, and unloads to zero like any other. The tests run in order."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ray import serve

from rayrunner.replica.model_server import DEPLOYMENT
from tests.conftest import Service, model_entry

AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1,
               "downscale_delay_s": 5, "look_back_period_s": 12}  # above Serve's 10 s metrics interval


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {"models": [model_entry("duo", tiny_llama_dir, num_replicas=2),
                         model_entry("elastic", tiny_llama_dir, load=False, autoscaling_config=AUTOSCALING),
                         model_entry("sticky", tiny_llama_dir, load=False, num_replicas=2, routing="prefix")],
              "state_path": str(cluster["state_dir"] / "replicas.json")}
    svc = Service(cluster, config)
    svc.wait_loaded("duo")
    yield svc
    svc.close()


def replicas(service: Service, model: str) -> dict[str, int]:
    return dict(service.card(model)["replicas"])


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.5)


def replica_infos(app: str) -> list[dict[str, Any]]:
    """Each live replica's info (one this process's handle still lists after it died answers an error)."""
    results = serve.get_deployment_handle(DEPLOYMENT, app_name=app).broadcast("info").results(
        timeout_s=60, return_exceptions=True)
    return [result for result in results if isinstance(result, dict)]


def chats(service: Service, model: str, count: int, **extra: Any) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: service.chat(f"hello {i}", model=model, max_tokens=24, **extra),
                             range(count)))


def test_two_replicas_share_the_load(service: Service) -> None:
    wait_for(lambda: replicas(service, "duo")["running"] == 2, "both replicas running")
    assert replicas(service, "duo") == {"running": 2, "starting": 0, "target": 2}
    before = sum(info["requests_served"] for info in replica_infos("duo"))
    assert all(reply.status_code == 200 for reply in chats(service, "duo", 32))
    served = [info["requests_served"] for info in replica_infos("duo")]
    assert sum(served) - before == 32 and all(count >= 8 for count in served), served


def first_chunk_then_drain(service: Service, model: str, stop: threading.Event, started: threading.Event,
                           **extra: Any) -> None:
    """One long stream: `started` set at its first chunk, closed (the client leaving) once `stop` is set."""
    body = {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900,
            "ignore_eos": True, "stream": True, **extra}
    with service.http.stream("POST", "/v1/chat/completions", json=body) as response:
        for _ in response.iter_lines():
            started.set()
            if stop.is_set():
                return


def test_a_request_goes_to_the_replica_with_fewer_sequences(service: Service) -> None:
    """One stream of n=4 on one replica: the next three single streams, sent at once, all go to the other (by
    requests, Serve's default would split them). Asserted on each replica's count of requests taken, which only
    grows, so it does not matter when a stream ends or a replica reports."""
    wait_for(lambda: len(replica_infos("duo")) == 2, "both replicas serving")
    stop = threading.Event()
    started = [threading.Event() for _ in range(4)]
    start = served_by_pid("duo")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        try:
            pool.submit(first_chunk_then_drain, service, "duo", stop, started[0], n=4)
            assert started[0].wait(60)
            heavy = [pid for pid, count in served_by_pid("duo").items() if count > start[pid]]
            for event in started[1:]:
                pool.submit(first_chunk_then_drain, service, "duo", stop, event)
            assert all(event.wait(60) for event in started[1:])
            taken = {pid: count - start[pid] for pid, count in served_by_pid("duo").items()}
            assert len(heavy) == 1 and sorted(taken.values()) == [1, 3] and taken[heavy[0]] == 1, (heavy, taken)
        finally:
            stop.set()
    wait_for(lambda: sum(info["sequences"] for info in replica_infos("duo")) == 0, "the streams ending")


def served_by_pid(model: str) -> dict[int, int]:
    """Each replica's count of generation requests taken, by its pid."""
    return {info["pid"]: info["requests_served"] for info in replica_infos(model)}


def served(model: str) -> list[int]:
    return [count for _, count in sorted(served_by_pid(model).items())]


def test_prefix_routing_keeps_a_user_on_one_replica(service: Service) -> None:
    assert service.chat("hi", model="sticky", max_tokens=2).status_code == 200  # loads it
    wait_for(lambda: replicas(service, "sticky")["running"] == 2, "both replicas running")
    start = served("sticky")
    for i in range(16):  # one user after another, each on its own replica: the users spread over both
        assert service.chat("hello", model="sticky", max_tokens=2, user=f"user {i}").status_code == 200
    before = served("sticky")
    assert all(b > s for b, s in zip(before, start, strict=True)), (start, before)
    assert all(reply.status_code == 200 for reply in chats(service, "sticky", 8, user="alice"))
    assert sorted(a - b for a, b in zip(served("sticky"), before, strict=True)) == [0, 8]
    assert service.http.post("/v1/models/unload", json={"model_id": "sticky"}).status_code == 200


def test_sleep_and_wake_take_every_replica(service: Service) -> None:
    assert service.http.post("/v1/models/unload", json={"model_id": "duo", "mode": "sleep"}).status_code == 200
    assert [info["asleep"] for info in replica_infos("duo")] == [True, True]
    assert service.chat("hi", model="duo", max_tokens=2).status_code == 200  # wakes them
    assert [info["asleep"] for info in replica_infos("duo")] == [False, False]


def test_unload_stops_every_replica_and_reload_brings_them_back(service: Service) -> None:
    assert service.http.post("/v1/models/unload", json={"model_id": "duo"}).status_code == 200
    assert replicas(service, "duo")["running"] == 0 and service.card("duo")["status"] == "unloaded"
    assert service.http.post("/v1/models/reload", json={"model_id": "duo"}).status_code == 200
    assert replicas(service, "duo")["running"] >= 1  # answered at its first replica
    wait_for(lambda: replicas(service, "duo")["running"] == 2, "the second replica back")


def test_a_replica_killed_under_load_loses_no_unary_request(service: Service) -> None:
    """Requests the dead replica held had sent nothing back yet: the router sends them again to the survivor."""
    victim = replica_infos("duo")[0]["pid"]
    killer = threading.Timer(0.3, os.kill, (victim, signal.SIGKILL))
    killer.start()
    replies = chats(service, "duo", 16, ignore_eos=True)
    killer.join()
    assert [reply.status_code for reply in replies] == [200] * 16, [r.text for r in replies if r.status_code != 200]
    assert all(reply.status_code == 200 for reply in chats(service, "duo", 8))  # the survivor answers at once
    wait_for(lambda: replicas(service, "duo")["running"] == 2, "Serve restoring the count")
    wait_for(lambda: len(replica_infos("duo")) == 2, "this process's handle seeing the replacement")
    assert victim not in [info["pid"] for info in replica_infos("duo")]


def test_a_new_replica_count_in_the_config_rescales_in_place(service: Service) -> None:
    """The config redeployed with `duo` on one replica: Serve drains one of the two, restarts none, and a stream
    running meanwhile ends whole."""
    wait_for(lambda: len(replica_infos("duo")) == 2, "both replicas serving")
    pids = {info["pid"] for info in replica_infos("duo")}
    body = {"model": "duo", "messages": [{"role": "user", "content": "go"}], "max_tokens": 600, "ignore_eos": True,
            "stream": True}
    with service.http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        entries = [dict(entry, spec={**entry["spec"], "engine": {**entry["spec"]["engine"], "num_replicas": 1}})
                   if entry["spec"]["model_id"] == "duo" else entry for entry in service.config["models"]]
        Service(service.cluster, {**service.config, "models": entries})  # `serve run` again with the new count
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in event for event in events)
    assert service.card("duo")["status"] == "loaded"
    wait_for(lambda: replicas(service, "duo") == {"running": 1, "starting": 0, "target": 1}, "one replica left")
    assert {info["pid"] for info in replica_infos("duo")} < pids  # the survivor was not restarted


def test_the_scale_call_rescales_in_place_and_refuses_bad_settings(service: Service) -> None:
    survivor = {info["pid"] for info in replica_infos("duo")}
    answer = service.http.post("/v1/models/scale", json={"model_id": "duo", "num_replicas": 2})
    assert answer.status_code == 200 and answer.json()["status"] == "loaded", answer.text
    wait_for(lambda: len(replica_infos("duo")) == 2, "the second replica")
    assert survivor < {info["pid"] for info in replica_infos("duo")}  # added beside it, nothing restarted
    for body, param in (({"num_replicas": 0}, "num_replicas"), ({"routing": "random"}, "routing")):
        refused = service.http.post("/v1/models/scale", json={"model_id": "duo", **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    assert service.http.post("/v1/models/scale", json={"model_id": "nope", "num_replicas": 2}).status_code == 404
    assert service.card("duo")["spec"]["engine"]["num_replicas"] == 2


def test_an_autoscaled_model_grows_under_streams_and_shrinks_idle(service: Service) -> None:
    # duo's two replicas are done with: their cores go to the streams (on 2 cores they decided whether Serve's
    # autoscaler, which looks back over 10 s metrics, added the second replica within the time)
    assert service.http.post("/v1/models/unload", json={"model_id": "duo"}).status_code == 200
    assert service.chat("hi", model="elastic", max_tokens=2).status_code == 200  # loads it, one replica
    assert replicas(service, "elastic")["target"] == 1
    stop = threading.Event()

    def stream() -> None:
        while not stop.is_set():
            body = {"model": "elastic", "messages": [{"role": "user", "content": "go"}], "max_tokens": 400,
                    "ignore_eos": True, "stream": True}
            with service.http.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    pass

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(16):
            pool.submit(stream)
        try:
            wait_for(lambda: replicas(service, "elastic")["running"] == 2, "scaling up to 2", timeout_s=90)
        finally:
            stop.set()
    wait_for(lambda: replicas(service, "elastic")["target"] == 1, "scaling back to 1 when idle", timeout_s=60)
    assert service.http.post("/v1/models/unload", json={"model_id": "elastic"}).status_code == 200
    time.sleep(3)  # nothing brings it back on its own: zero is the registry's
    assert replicas(service, "elastic")["running"] == 0 and service.card("elastic")["status"] == "unloaded"
    assert service.chat("hi", model="elastic", max_tokens=2).status_code == 200  # loads it again
    assert replicas(service, "elastic")["target"] == 1
