"""Restarting the router with an edited config: the config wins for the models and the default it declares, while
what was changed at runtime stays. Tiny models; the registry keeps its state file between the restarts."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Service, cleanup_serve, model_entry


@pytest.fixture(scope="module")
def base(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[dict[str, Any]]:
    embedding = {"model_id": "emb", "which": {"type": "embedding", "model_id": "all-minilm-l6-v2"}}
    yield {
        "models": [
            model_entry("m1", tiny_llama_dir, aliases=["one"]),
            model_entry("m2", tiny_llama_dir, load=False),
            {"spec": embedding, "aliases": [], "load": False},
        ],
        "default_model": "m1",
        "state_path": str(cluster["state_dir"] / "config_changes.json"),
    }
    cleanup_serve()


def kill_registry() -> None:
    """As when the cluster stops: the next registry starts from its file."""
    import ray

    from rayrunner.registry.actor import NAMESPACE, REGISTRY_NAME

    ray.kill(ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE), no_restart=True)
    while True:
        try:
            ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.1)


def wait_loaded(service: Service, model: str) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while (card := service.card(model))["status"] != "loaded":
        assert time.monotonic() < deadline, f"{model} never loaded: {card}"
        time.sleep(0.2)
    return card


def info(service: Service, model: str) -> dict[str, Any]:
    result: dict[str, Any] = service.handle.model_card.remote(model).result()["info"]
    return result


def test_an_edited_config_wins_for_what_it_declares_and_runtime_changes_stay(cluster: dict[str, Any],
                                                                             base: dict[str, Any]) -> None:
    first = Service(cluster, base)
    wait_loaded(first, "m1")
    old_pid = info(first, "m1")["pid"]
    # Runtime changes: a default, an alias, a model.
    assert first.http.post("/v1/models/default", json={"model_id": "m2"}).status_code == 200
    assert first.http.post("/v1/models/aliases", json={"model_id": "m1", "alias": "uno"}).status_code == 200
    extra = {"model_id": "extra", "which": base["models"][0]["spec"]["which"], "load": False}
    assert first.http.post("/v1/models/add", json=extra).status_code == 201

    edited = copy.deepcopy(base)
    edited["models"][0]["spec"]["in_situ_quant"] = "Q8_0"
    kill_registry()
    second = Service(cluster, edited)
    card = wait_loaded(second, "m1")
    assert card["spec"]["in_situ_quant"] == "Q8_0" and card["aliases"] == ["one", "uno"]
    running = info(second, "m1")
    assert running["pid"] != old_pid, "m1 kept running the spec the config replaced"
    assert running["quantization"]["requested"] == "Q8_0"
    assert second.http.get("/v1/models/default").json()["id"] == "m2"  # the config's default did not change
    assert second.card("extra")["status"] == "unloaded"

    # The same registry (no restart) and a config whose default changed: the config's default is taken.
    edited["default_model"] = "one"
    third = Service(cluster, edited)
    assert third.http.get("/v1/models/default").json()["id"] == "m1"
    assert info(third, "m1")["pid"] == running["pid"]  # an unchanged spec is not redeployed


def test_without_a_model_of_its_kind_left_there_is_no_default(cluster: dict[str, Any], base: dict[str, Any]) -> None:
    service = Service(cluster, base)
    wait_loaded(service, "m1")  # loaded before this router started: it loads again (a remove meanwhile is a 409)
    for model in ("m1", "m2", "extra"):
        assert service.http.post("/v1/models/remove", json={"model_id": model}).status_code == 200
    response = service.chat("hi")
    assert response.status_code == 404, response.text
    assert "no default model is set" in response.json()["error"]["message"]
    assert service.http.get("/v1/models/default").status_code == 404
    assert not service.card("emb")["is_default"]
