"""Hardening on a real service: API keys, request limits, safe sources, start-up at deploy time, one registry per
service, and registry operations racing each other."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from rayrunner.models.spec import ModelSpec, model_app_name
from rayrunner.registry import model_apps
from rayrunner.registry.state import ModelRecord, RegistryState
from tests.conftest import Service, model_entry

USER, ADMIN = "user-key-123", "admin-key-456"
TIMEOUT_S = 2.5  # longer than a tiny chat


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {
        "models": [model_entry("tiny", tiny_llama_dir, aliases=["t"]),
                   model_entry("cold", tiny_llama_dir, load=False)],
        "state_path": str(cluster["state_dir"] / "hardening.json"),
        "sources": {"local_roots": [tiny_llama_dir]},  # no hub organisation, one local folder
        "auth": {"api_keys": [USER], "admin_api_keys": [ADMIN]},
        "limits": {"max_body_bytes": 8192, "max_tokens": 16, "request_timeout_s": TIMEOUT_S},
    }
    svc = Service(cluster, config)
    svc.http.headers["authorization"] = f"Bearer {USER}"
    yield svc
    svc.close()


def admin(service: Service, path: str, key: str | None = ADMIN, **body: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {"authorization": ""}
    return service.http.post(f"/v1/models/{path}", json=body, headers=headers)


def wait_until(check: Any, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


def test_load_true_models_load_at_deploy_time_without_traffic(service: Service) -> None:
    wait_until(lambda: model_apps.app_state(model_app_name("tiny")).running >= 1, "tiny to load on its own")
    assert model_apps.app_state(model_app_name("cold")).exists is False


def test_inference_needs_a_key(service: Service) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for headers in ({"authorization": ""}, {"authorization": "Bearer nope"}):
        response = service.http.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert USER not in response.text and ADMIN not in response.text
    assert service.http.post("/v1/chat/completions", json=body).status_code == 200
    assert service.http.get("/health", headers={"authorization": ""}).json() == {"status": "ok"}


def test_every_admin_route_refuses_without_the_admin_key_and_changes_nothing(service: Service) -> None:
    before = service.http.get("/v1/models").json()
    attempts = [("unload", {"model_id": "tiny"}), ("reload", {"model_id": "cold"}), ("remove", {"model_id": "tiny"}),
                ("default", {"model_id": "cold"}), ("aliases", {"model_id": "tiny", "alias": "new"}),
                ("add", {"model_id": "x", "which": {"type": "embedding", "model_id": "all-minilm-l6-v2"},
                         "load": False})]
    for path, body in attempts:
        assert admin(service, path, None, **body).status_code == 401, path
        refused = admin(service, path, USER, **body)
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied", path
    after = service.http.get("/v1/models").json()
    assert [(m["id"], m["status"], m.get("aliases")) for m in after["data"]] == \
           [(m["id"], m["status"], m.get("aliases")) for m in before["data"]]
    assert admin(service, "aliases", model_id="tiny", alias="tee").status_code == 200


def test_body_over_the_limit_is_413(service: Service) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 10_000}]}
    response = service.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


def test_max_tokens_over_the_limit_is_400_and_unset_is_capped(service: Service) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    response = service.http.post("/v1/chat/completions", json={**body, "max_tokens": 17})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    reply = service.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 16


def test_a_request_past_the_timeout_is_408_and_the_load_it_started_finishes(service: Service) -> None:
    """The cold model's replica waits for CPUs that actors started here hold, so its load outlasts the timeout on
    any box (a load waiting for room, as on a full cluster); once they go, the load finishes."""
    holders = _hold_free_cpus()
    try:
        body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = service.http.post("/v1/chat/completions", json=body)
        assert response.status_code == 408 and response.json()["error"]["code"] == "request_timeout"
        assert service.card("cold")["status"] == "reloading"
    finally:
        _release(holders)
    wait_until(lambda: service.card("cold")["status"] == "loaded", "the cold model to finish loading")
    assert service.http.post("/v1/chat/completions", json=body).status_code == 200


def _hold_free_cpus() -> list[Any]:
    """Actors holding every CPU the cluster has free (Ray takes fractions only below 1: a whole part and a rest),
    until less than a replica's `num_cpus` is left: CPUs a finished test's replica frees meanwhile are taken too."""
    import ray

    from rayrunner.models.spec import EngineSettings

    @ray.remote
    class Holder:
        def ready(self) -> bool:
            return True

    holders: list[Any] = []
    while (free := round(ray.available_resources().get("CPU", 0.0), 4)) >= EngineSettings().num_cpus:
        whole, rest = divmod(free, 1)
        held = [Holder.options(num_cpus=amount).remote() for amount in (whole, rest) if amount > 0]  # type: ignore[attr-defined]
        ray.get([holder.ready.remote() for holder in held], timeout=60)
        holders += held
        time.sleep(0.5)  # the resource view catches up
    return holders


def _release(holders: list[Any]) -> None:
    import ray

    for holder in holders:
        ray.kill(holder)


def test_runtime_adds_only_from_allowed_sources(service: Service, tmp_path: Path) -> None:
    refused = admin(service, "add", model_id="local", which={"type": "plain", "model_id": str(tmp_path)})
    assert refused.status_code == 403 and refused.json()["error"]["param"] == "which.model_id"
    refused = admin(service, "add", model_id="hub", which={"type": "plain", "model_id": "org/model"})
    assert refused.status_code == 403
    assert "local" not in {m["id"] for m in service.http.get("/v1/models").json()["data"]}
    added = admin(service, "add", model_id="mini", which={"type": "embedding", "model_id": "all-minilm-l6-v2"},
                  load=False)
    assert added.status_code == 201, added.text
    assert admin(service, "remove", model_id="mini").status_code == 200


def test_remove_racing_a_load_never_leaves_an_app_for_a_removed_model(service: Service, tiny_llama_dir: str) -> None:
    """A request (which loads the model) and a remove, sent together: whatever order they run in, a removed model
    has no app, a kept one is consistent, and nothing is stuck reloading."""
    entry = model_entry("racer", tiny_llama_dir, load=False)
    app = model_app_name("racer")
    chat = {"model": "racer", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(2):
        assert admin(service, "add", model_id="racer", which=entry["spec"]["which"], load=False).status_code == 201
        with ThreadPoolExecutor(2) as pool:
            asked = pool.submit(service.http.post, "/v1/chat/completions", json=chat)
            removed = pool.submit(admin, service, "remove", ADMIN, model_id="racer")
            statuses = (asked.result().status_code, removed.result().status_code)
        assert statuses[0] in (200, 404, 408, 409, 503) and statuses[1] in (200, 409), statuses
        while admin(service, "remove", model_id="racer").status_code == 409:  # it was loading: remove it now
            time.sleep(0.5)
        assert "racer" not in {m["id"] for m in service.http.get("/v1/models").json()["data"]}
        wait_until(lambda: not model_apps.app_state(app).exists, "no app left for the removed model", 30)


def test_set_default_racing_remove_keeps_the_routes_valid(service: Service) -> None:
    which = {"type": "embedding", "model_id": "all-minilm-l6-v2"}
    for _ in range(2):
        assert admin(service, "add", model_id="fleeting", which=which, load=False).status_code == 201
        with ThreadPoolExecutor(2) as pool:
            moved = pool.submit(admin, service, "default", ADMIN, model_id="fleeting")
            removed = pool.submit(admin, service, "remove", ADMIN, model_id="fleeting")
            assert moved.result().status_code in (200, 404, 409) and removed.result().status_code == 200
        listed = service.http.get("/v1/models")
        assert listed.status_code == 200 and "fleeting" not in {m["id"] for m in listed.json()["data"]}
        default = service.http.get("/v1/models/default")
        assert default.status_code in (200, 404) and default.json().get("id") != "fleeting"
        assert admin(service, "default", model_id="tiny").status_code == 200


def test_each_router_app_has_its_own_registry(service: Service, cluster: dict[str, Any], tiny_llama_dir: str) -> None:
    import ray
    from ray import serve

    from rayrunner.registry.actor import NAMESPACE, registry_name
    from rayrunner.router.app import build_router_app

    config = {"models": [model_entry("other-model", tiny_llama_dir, load=False)],
              "state_path": str(cluster["state_dir"] / "other.json")}
    serve.run(build_router_app(config), name="other", route_prefix="/other")
    try:
        others = httpx.get(f"{service.url}/other/v1/models").json()["data"]
        assert [m["id"] for m in others] == ["other-model"]
        mine = {m["id"] for m in service.http.get("/v1/models").json()["data"]}
        assert "other-model" not in mine and "tiny" in mine
        assert ray.get_actor(registry_name("other"), namespace=NAMESPACE) != \
               ray.get_actor(registry_name(), namespace=NAMESPACE)
    finally:
        serve.delete("other")
        ray.kill(ray.get_actor(registry_name("other"), namespace=NAMESPACE))


def test_a_config_that_cannot_apply_fails_the_deploy(cluster: dict[str, Any], tiny_llama_dir: str,
                                                   tmp_path: Path) -> None:
    """The saved state gives alias `x` to a runtime model; a config declaring a new model with that alias cannot
    apply, and the deploy fails with the reason instead of answering 500 to the first request."""
    from ray import serve

    from rayrunner.router.app import build_router_app

    spec = ModelSpec.model_validate(model_entry("runtime", tiny_llama_dir)["spec"])
    state = RegistryState(models={"runtime": ModelRecord(spec=spec, aliases=["x"])}, default_id="runtime")
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(state.model_dump(mode="json")))
    config = {"models": [model_entry("declared", tiny_llama_dir, load=False, aliases=["x"])],
              "state_path": str(state_path)}
    try:
        with pytest.raises(RuntimeError, match="Deploying application broken failed"):
            serve.run(build_router_app(config), name="broken", route_prefix="/broken")
        app = serve.status().applications["broken"]
        assert app.status == "DEPLOY_FAILED"
        assert "alias `x` already points at model `runtime`" in app.deployments["Router"].message
    finally:
        serve.delete("broken")
        _kill_registry("broken")


def _kill_registry(app: str) -> None:
    import contextlib

    import ray

    from rayrunner.registry.actor import NAMESPACE, registry_name

    with contextlib.suppress(ValueError):
        ray.kill(ray.get_actor(registry_name(app), namespace=NAMESPACE))
