"""Multi-model lifecycle on a real cluster: unload = scale to zero, reload, auto-reload, default, aliases,
add/remove at runtime, failure handling and registry restarts. Uses tiny random models except where memory matters."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import Service, model_entry


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {
        "models": [
            model_entry("alpha", tiny_llama_dir, aliases=["a"]),
            model_entry("org/beta", tiny_llama_dir, load=False, aliases=["b"]),
        ],
        "default_model": "alpha",
        "state_path": str(cluster["state_dir"] / "lifecycle.json"),
    }
    svc = Service(cluster, config)
    yield svc
    svc.close()


def status(service: Service, model: str) -> str:
    response = service.http.post("/v1/models/status", json={"model_id": model})
    assert response.status_code == 200, response.text
    return str(response.json()["status"])


def post(service: Service, path: str, **body: Any) -> Any:
    return service.http.post(f"/v1/models/{path}", json=body)


def wait_status(service: Service, model: str, wanted: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while status(service, model) != wanted:
        assert time.monotonic() < deadline, f"{model} never became {wanted}"
        time.sleep(0.2)


def ensure(service: Service, model: str, wanted: str) -> None:
    if status(service, model) != wanted:
        assert post(service, "reload" if wanted == "loaded" else "unload", model_id=model).status_code == 200


def test_declared_models_start_in_their_declared_state(service: Service) -> None:
    wait_status(service, "alpha", "loaded")
    cards = {m["id"]: m for m in service.http.get("/v1/models").json()["data"]}
    assert cards["alpha"]["status"] == "loaded" and cards["alpha"]["is_default"]
    assert cards["org/beta"]["status"] == "unloaded" and cards["org/beta"]["aliases"] == ["b"]


def test_request_to_unloaded_model_reloads_it(service: Service) -> None:
    ensure(service, "org/beta", "unloaded")
    response = service.chat("hello", model="b", max_tokens=4)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "org/beta"
    assert status(service, "org/beta") == "loaded"


def test_concurrent_requests_share_one_load(service: Service) -> None:
    ensure(service, "org/beta", "unloaded")
    loads_before = service.card("org/beta")["load_count"]
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: service.chat(f"hi {i}", model="org/beta", max_tokens=4), range(8)))
    assert [r.status_code for r in responses] == [200] * 8
    assert service.card("org/beta")["load_count"] == loads_before + 1


def test_conflicting_lifecycle_calls_get_409_and_404(service: Service) -> None:
    ensure(service, "org/beta", "unloaded")
    again = post(service, "unload", model_id="org/beta")
    assert again.status_code == 409 and again.json()["error"]["code"] == "model_already_unloaded"
    loaded = post(service, "reload", model_id="alpha")
    assert loaded.status_code == 409 and loaded.json()["error"]["code"] == "model_already_loaded"
    for path in ("unload", "reload", "status", "remove", "default"):
        missing = post(service, path, model_id="nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_failed_reload_leaves_model_unloaded_with_error(service: Service, tiny_llama_dir: str,
                                                        tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, broken)
    added = post(service, "add", model_id="fragile", which={"type": "plain", "model_id": str(broken)})
    assert added.status_code == 201, added.text
    assert post(service, "unload", model_id="fragile").status_code == 200
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"this is not a safetensors file")
    failed = post(service, "reload", model_id="fragile")
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "model_load_failed"
    assert "failed to reload model" in failed.json()["error"]["message"]
    card = service.card("fragile")
    assert card["status"] == "unloaded" and card["last_error"]
    assert post(service, "remove", model_id="fragile").status_code == 200


def test_unload_frees_the_replica_and_its_memory(service: Service) -> None:
    added = post(service, "add", model_id="smol", which={"type": "plain", "model_id": "smollm2-135m-instruct"})
    assert added.status_code == 201, added.text
    info = service.handle.model_card.remote("smol").result()["info"]
    pid, weights = info["pid"], info["weight_bytes"]
    # The replica's own memory (USS: pages no other process shares) holds the weights, and goes with its process.
    # Not the machine's used memory: the spare worker the load left behind imports torch meanwhile (~300 MB).
    unique = psutil.Process(pid).memory_full_info().uss
    assert unique >= weights, f"the replica holds {unique} bytes of its own, less than {weights} weight bytes"
    assert post(service, "unload", model_id="smol").json() == {"model_id": "smol", "status": "unloaded"}
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(pid)
    assert post(service, "remove", model_id="smol").status_code == 200


def test_stream_in_flight_finishes_before_unload(service: Service) -> None:
    ensure(service, "org/beta", "loaded")
    body = {"model": "org/beta", "messages": [{"role": "user", "content": "go"}], "max_tokens": 200,
            "stream": True, "stop": []}
    finished: dict[str, float] = {}
    lines: list[str] = []

    def consume() -> None:
        with service.http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
        finished["stream"] = time.monotonic()

    reader = threading.Thread(target=consume)
    reader.start()
    while not any('"content"' in line for line in lines):
        time.sleep(0.01)
    assert post(service, "unload", model_id="org/beta", mode="sleep").status_code == 200  # a stop drains alike
    finished["unload"] = time.monotonic()
    reader.join()
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and '"finish_reason"' in data[-2] and "error" not in data[-2]
    assert finished["stream"] <= finished["unload"]


def test_default_switching_and_aliases(service: Service) -> None:
    ensure(service, "org/beta", "loaded")
    assert post(service, "default", model_id="b").json()["id"] == "org/beta"
    assert post(service, "default", model_id="b").status_code == 200  # already the default: nothing to change
    assert service.http.get("/v1/models/default").json()["id"] == "org/beta"
    assert service.chat("hi", max_tokens=3).json()["model"] == "org/beta"
    assert post(service, "aliases", model_id="org/beta", alias="beta2").status_code == 200
    again = post(service, "aliases", model_id="org/beta", alias="beta2")  # already so: nothing to change
    assert again.status_code == 200 and again.json()["aliases"] == ["b", "beta2"]
    assert service.chat("hi", model="beta2", max_tokens=3).json()["model"] == "org/beta"
    clash = post(service, "aliases", model_id="alpha", alias="beta2")
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "alias_conflict"
    reserved = post(service, "aliases", model_id="alpha", alias="default")
    assert reserved.status_code == 409
    # Unloading the default leaves it the default; the next `default` request reloads it (here: wakes it).
    assert post(service, "unload", model_id="org/beta", mode="sleep").status_code == 200
    assert service.http.get("/v1/models/default").json()["id"] == "org/beta"
    assert service.chat("hi", max_tokens=3).json()["model"] == "org/beta"
    assert status(service, "org/beta") == "loaded"
    assert post(service, "default", model_id="alpha").status_code == 200


def test_removing_the_default_moves_it_to_a_model_of_its_kind(service: Service, tiny_llama_dir: str) -> None:
    embedding = {"type": "embedding", "model_id": "all-minilm-l6-v2"}
    assert post(service, "add", model_id="emb", which=embedding, load=False).status_code == 201
    which = {"type": "plain", "model_id": tiny_llama_dir}
    assert post(service, "add", model_id="zeta", which=which, load=False).status_code == 201
    assert post(service, "default", model_id="zeta").status_code == 200
    assert post(service, "remove", model_id="zeta").status_code == 200
    assert service.http.get("/v1/models/default").json()["id"] == "alpha"  # a loaded text model, not `emb`
    assert post(service, "remove", model_id="emb").status_code == 200


def test_add_and_remove_at_runtime(service: Service, tiny_llama_dir: str) -> None:
    which = {"type": "plain", "model_id": tiny_llama_dir}
    added = post(service, "add", model_id="gamma", which=which, aliases=["g"], load=False)
    assert added.status_code == 201 and added.json()["status"] == "unloaded"
    same = post(service, "add", model_id="gamma", which=which, aliases=["g"])  # the same spec: attach, and load
    assert same.status_code == 200 and same.json()["status"] == "loaded" and same.json()["aliases"] == ["g"]
    other = post(service, "add", model_id="gamma", which=which, engine={"default_max_tokens": 7})
    assert other.status_code == 409 and other.json()["error"]["code"] == "model_exists"
    assert "engine.default_max_tokens: 256 -> 7" in other.json()["error"]["message"]
    alias_clash = post(service, "add", model_id="delta", which=which, aliases=["a"])
    assert alias_clash.status_code == 409 and alias_clash.json()["error"]["code"] == "alias_conflict"
    invalid = post(service, "add", model_id="bad", which={"type": "plain"})
    assert invalid.status_code == 400
    bad_isq = post(service, "add", model_id="bad", which=which, in_situ_quant="Q9Z")
    assert bad_isq.status_code == 400 and "Q4K" in bad_isq.json()["error"]["message"]
    assert service.chat("hi", model="g", max_tokens=3).status_code == 200
    assert post(service, "remove", model_id="g").json() == {"model_id": "gamma", "removed": True}
    assert service.chat("hi", model="gamma").status_code == 404
    assert "gamma" not in [m["id"] for m in service.http.get("/v1/models").json()["data"]]


def test_a_responses_request_keep_alive_sets_the_models_deadline(service: Service) -> None:
    ensure(service, "org/beta", "loaded")
    body = {"model": "b", "input": "hi", "max_output_tokens": 2, "keep_alive": 0}
    answered = service.http.post("/v1/responses", json=body)
    assert answered.status_code == 200, answered.text
    wait_status(service, "org/beta", "unloaded", timeout_s=30)  # idle, and its keep_alive of 0 ran out
    assert service.card("org/beta")["unloaded_reason"] == "idle"


def test_model_a_keeps_serving_while_b_changes(service: Service, tiny_llama_dir: str) -> None:
    stop = threading.Event()
    codes: list[int] = []

    def hammer() -> None:
        while not stop.is_set():
            codes.append(service.chat("ping", model="alpha", max_tokens=2).status_code)
            time.sleep(0.1)  # steady traffic, not a busy loop that starves the load beside it on a small box

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        which = {"type": "plain", "model_id": tiny_llama_dir}
        assert post(service, "add", model_id="epsilon", which=which).status_code == 201  # a deploy and a load
        assert post(service, "remove", model_id="epsilon").status_code == 200  # an app deleted
    finally:
        stop.set()
        worker.join()
    assert len(codes) >= 3 and set(codes) == {200}


def test_registry_survives_being_killed(service: Service) -> None:
    import ray

    from rayrunner.registry.actor import NAMESPACE, REGISTRY_NAME

    def snapshot(data: list[dict[str, Any]]) -> dict[str, Any]:
        return {m["id"]: (m["status"], m["aliases"], m["is_default"]) for m in data}

    before = snapshot(service.http.get("/v1/models").json()["data"])
    ray.kill(ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE), no_restart=False)
    deadline = time.monotonic() + 60
    while True:
        response = service.http.get("/v1/models")
        if response.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    after = snapshot(response.json()["data"])
    assert after == before
    assert service.chat("hi", model="a", max_tokens=2).status_code == 200


def test_router_follows_registry_changes_made_elsewhere(service: Service) -> None:
    """Routers keep a copy of the routes, long-polled from the registry: a change made on the registry actor itself
    (not through this router) reaches routing within moments, also after the registry restarted (test above)."""
    import ray

    from rayrunner.registry.actor import NAMESPACE, REGISTRY_NAME

    def default_routes_to(model_id: str) -> None:
        deadline = time.monotonic() + 10
        while service.chat("hi", max_tokens=2).json()["model"] != model_id:
            assert time.monotonic() < deadline, f"`default` never routed to {model_id}"
            time.sleep(0.1)

    registry = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    ensure(service, "org/beta", "loaded")
    try:
        ray.get(registry.set_default.remote("org/beta"))
        default_routes_to("org/beta")
    finally:
        ray.get(registry.set_default.remote("alpha"))
    default_routes_to("alpha")
