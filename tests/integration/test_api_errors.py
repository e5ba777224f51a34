"""Failures as a client sees them over real HTTP: a replica killed mid-stream gives a short, stable, retryable error
with none of Ray's internals (node IP, pid, actor id), and the model answers again once Serve has replaced it; a
model whose queue is full answers 429 with `Retry-After`, before a stream opens too."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.conftest import Service, model_entry

MODEL = "victim"
TIGHT = "tight"  # one sequence at a time, one waiting
LONG = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1900}
BUSY = {**LONG, "max_tokens": 600}  # seconds of work: the running one outlasts the others' arrival


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    models = [model_entry(MODEL, tiny_llama_dir),
              model_entry(TIGHT, tiny_llama_dir, max_num_seqs=1, max_queued_requests=1)]
    config = {"models": models, "state_path": str(cluster["state_dir"] / "errors.json")}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def replica_info(model: str) -> dict[str, Any]:
    """The info of the model's current replica (asked of the replica itself: after a restart the card is stale)."""
    from ray import serve

    from rayrunner.models.spec import model_app_name
    from rayrunner.replica.model_server import DEPLOYMENT

    handle = serve.get_deployment_handle(DEPLOYMENT, app_name=model_app_name(model))
    info: dict[str, Any] = handle.info.remote().result()
    return info


def replica_pid(model: str) -> int:
    return int(replica_info(model)["pid"])


def test_replica_killed_mid_stream_gives_a_stable_error(service: Service) -> None:
    assert service.chat("hello", model=MODEL, max_tokens=2).status_code == 200  # loaded and warm
    pid = replica_pid(MODEL)
    body = {"model": MODEL, **LONG, "stream": True}
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


def test_full_queue_answers_429_with_retry_after(service: Service) -> None:
    assert service.chat("hello", model=TIGHT, max_tokens=2).status_code == 200  # loaded and warm
    kinds = [False, True] * 4  # unary, and streaming (refused before the stream opens)

    def send(stream: bool) -> Any:
        return service.http.post("/v1/chat/completions", json={"model": TIGHT, **BUSY, "stream": stream})

    with ThreadPoolExecutor(len(kinds)) as pool:  # at once: one runs, one waits, the others find the queue full
        responses = list(pool.map(send, kinds))
    refused = [stream for stream, r in zip(kinds, responses, strict=True) if r.status_code == 429]
    # Exactly one running and one waiting are accepted; which two arrive first is up to the network.
    assert len(refused) == len(kinds) - 2 and set(refused) == {False, True}, [r.status_code for r in responses]
    for response in responses:
        if response.status_code == 429:
            assert response.headers["retry-after"] == "1"
            assert response.json()["error"]["code"] == "server_overloaded"
        else:
            assert response.status_code == 200 and "retry-after" not in response.headers


def test_two_busy_replicas_share_the_cores_instead_of_each_taking_all(service: Service) -> None:
    """Two models decoding at once on one node: their engines' torch threads add up to at most the node's cores
    (each took every core before, and their OpenMP workers fought over them)."""
    from rayrunner.runtime.core_share import node_cores

    cores = node_cores()
    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(service.chat, "Tell a long story.", model=model, max_tokens=1900, ignore_eos=True)
                for model in (MODEL, TIGHT)]
        deadline = time.monotonic() + 60
        while not all(replica_info(model)["extra"]["scheduler"]["running"] for model in (MODEL, TIGHT)):
            assert time.monotonic() < deadline, "the two requests were never decoding at once"
            time.sleep(0.2)
        time.sleep(0.5)  # each engine past a recount of the busy ones
        threads = [replica_info(model)["extra"]["torch_threads"] for model in (MODEL, TIGHT)]
        assert all(not future.done() for future in busy), "a request ended before both were seen busy"
        assert sum(threads) <= cores and min(threads) >= 1, threads
        assert all(future.result().status_code == 200 for future in busy)
    assert replica_info(MODEL)["extra"]["torch_threads"] >= 1
