"""Faults on a real cluster, killed the way Ray kills things: a model replica mid-stream (`ray.kill` of its Serve
replica actor), the registry actor (it restarts and reads its state file back), the router replica (Serve replaces
it), and the whole service stopped and deployed again with the same config and state file. After each, statuses,
aliases and the default are what they were and requests are served again. The tests run in order."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.conftest import Service, cleanup_serve, model_entry

LONG_STREAM = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 1900, "stream": True}
RECOVERY_S = 180  # Serve replaces a dead replica, the registry restarts: generous on a busy 2-core machine


@pytest.fixture(scope="module")
def config(cluster: dict[str, Any], tiny_llama_dir: str) -> dict[str, Any]:
    return {
        "models": [model_entry("fault-a", tiny_llama_dir, aliases=["fa"]),
                   model_entry("org/fault-b", tiny_llama_dir, load=False, aliases=["fb"])],
        "default_model": "fault-a",
        "state_path": str(cluster["state_dir"] / "faults.json"),
    }


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], config: dict[str, Any]) -> Iterator[Service]:
    svc = Service(cluster, config)
    yield svc
    svc.close()


# ------------------------------------------------------------ helpers


def replica_actor(app: str, deployment: str) -> Any:
    """The handle of the one live Serve replica actor of `app`'s `deployment` (named `SERVE_REPLICA::app#dep#id`
    in the `serve` namespace)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == "serve" and a["name"].startswith(prefix)]
    assert len(names) == 1, f"expected one live replica of {app}/{deployment}, found {names}"
    return ray.get_actor(names[0], namespace="serve")


def registry_actor() -> Any:
    import ray

    from rayrunner.registry.actor import NAMESPACE, REGISTRY_NAME

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE and a["name"].startswith(REGISTRY_NAME)]
    assert len(names) == 1, f"expected one registry, found {names}"
    return ray.get_actor(names[0], namespace=NAMESPACE)


def snapshot(service: Service) -> dict[str, Any]:
    """Each model's (status, aliases, is_default): what a fault must not change."""
    data = service.http.get("/v1/models").json()["data"]
    return {m["id"]: (m["status"], m["aliases"], m["is_default"]) for m in data}


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = RECOVERY_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s} s"
        time.sleep(0.5)


def answers(service: Service, model: str) -> bool:
    """One short chat: True on 200; a documented 'retry' (503) is False; anything else fails the test."""
    response = service.chat("hello", model=model, max_tokens=2)
    if response.status_code == 200:
        return True
    assert response.status_code == 503, response.text
    assert response.json()["error"]["code"] == "model_unavailable", response.text
    return False


def admin(service: Service, path: str, **body: Any) -> Any:
    response = service.http.post(f"/v1/models/{path}", json=body)
    assert response.status_code in (200, 201), response.text
    return response.json()


# ------------------------------------------------------------ faults


def test_model_replica_killed_mid_stream(service: Service) -> None:
    import ray

    from rayrunner.replica.model_server import DEPLOYMENT

    assert answers(service, "fa")  # loaded and warm
    victim = replica_actor("fault-a", DEPLOYMENT)
    events: list[str] = []
    with service.http.stream("POST", "/v1/chat/completions", json={"model": "fa", **LONG_STREAM}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                if len(events) == 3:
                    ray.kill(victim, no_restart=True)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2]) == {"error": {"message": "model `fault-a` is unavailable right now; retry",
                                                "type": "server_error", "param": None, "code": "model_unavailable"}}
    assert all("error" not in json.loads(event) for event in events[:-2])
    wait_for(lambda: answers(service, "fa"), "a replacement replica answering")
    assert replica_actor("fault-a", DEPLOYMENT)._actor_id != victim._actor_id
    assert snapshot(service)["fault-a"][0] == "loaded"


def test_registry_killed_restarts_from_its_state_file(service: Service, tiny_llama_dir: str) -> None:
    import ray

    admin(service, "aliases", model_id="fault-a", alias="fa2")
    admin(service, "add", model_id="fault-c", which={"type": "plain", "model_id": tiny_llama_dir}, aliases=["fc"])
    admin(service, "default", model_id="fc")
    before = snapshot(service)
    assert before["org/fault-b"][0] == "unloaded" and before["fault-c"] == ("loaded", ["fc"], True)

    old = registry_actor()
    ray.kill(old, no_restart=False)
    wait_for(lambda: service.http.get("/v1/models").status_code == 200, "the registry answering again")
    assert registry_actor()._actor_id == old._actor_id  # the same actor, restarted by Ray
    assert snapshot(service) == before
    assert service.chat("hi", model="fa2", max_tokens=2).status_code == 200
    assert service.chat("hi", max_tokens=2).json()["model"] == "fault-c"
    reloaded = service.chat("hi", model="fb", max_tokens=2)  # an unloaded model still reloads on request
    assert reloaded.status_code == 200, reloaded.text
    admin(service, "unload", model_id="org/fault-b")


def test_router_replica_killed_is_replaced(service: Service) -> None:
    import ray

    before = snapshot(service)
    victim = replica_actor("rayrunner", "Router")
    ray.kill(victim, no_restart=True)

    def router_back() -> bool:
        try:
            return service.http.get("/health", timeout=10).status_code == 200
        except Exception:  # noqa: BLE001 - the proxy may drop the connection while no router is up
            return False

    wait_for(router_back, "a replacement router")
    assert replica_actor("rayrunner", "Router")._actor_id != victim._actor_id
    wait_for(lambda: answers(service, "default"), "the new router serving")
    assert snapshot(service) == before


RESTARTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}  # registry -> (before the stop, after the redeploy)


@pytest.mark.parametrize("registry", ["kept", "killed"])
def test_whole_service_stopped_and_deployed_again(service: Service, cluster: dict[str, Any],
                                                  config: dict[str, Any], registry: str) -> None:
    """`serve.delete` of the router and every model app, then the router deployed again with the same config and
    state file; the detached registry either survives (`kept`) or dies too (`killed`: read back from its file).
    Models, aliases and the default (set at runtime) are intact, unloaded models stay unloaded, and every loaded
    model answers. Whether loaded models were loaded again is the next test's."""
    from ray import serve

    for model_id, wanted in (("fault-a", "loaded"), ("org/fault-b", "unloaded"), ("fault-c", "loaded")):
        if snapshot(service)[model_id][0] != wanted:
            admin(service, "reload" if wanted == "loaded" else "unload", model_id=model_id)
    before = snapshot(service)
    assert before["fault-c"] == ("loaded", ["fc"], True)  # a runtime model, alias and default
    if registry == "killed":
        cleanup_serve()  # every app, and the registry with no restart
        with pytest.raises(AssertionError, match="found \\[\\]"):
            registry_actor()
    else:
        for app in list(serve.status().applications):
            serve.delete(app)
        registry_actor()  # still there
    restarted = Service(cluster, config)  # answers /health once the registry has settled every model
    try:
        wait_for(lambda: all(s != "reloading" for s, _, _ in snapshot(restarted).values()), "loads to finish")
        after = snapshot(restarted)
        RESTARTS[registry] = (before, after)
        assert {m: card[1:] for m, card in after.items()} == {m: card[1:] for m, card in before.items()}
        assert after["org/fault-b"][0] == "unloaded"
        assert restarted.chat("hi", max_tokens=2).json()["model"] == "fault-c"
        # Loaded models answer at once (an unloaded one loading on request is the registry test's)
        assert all(answers(restarted, model_id) for model_id, (status, _, _) in before.items() if status == "loaded")
    finally:
        restarted.http.close()


@pytest.mark.parametrize("registry", ["kept", "killed"])
def test_loaded_models_are_loaded_again_after_the_redeploy(registry: str) -> None:
    before, after = RESTARTS[registry]  # recorded by the test above, before any request could reload a model
    assert {m: s for m, (s, _, _) in after.items()} == {m: s for m, (s, _, _) in before.items()}
