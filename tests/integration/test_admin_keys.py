"""Keys on a real service: with inference keys and no admin keys, the admin API is off over HTTP (403 saying so)
while handles inside the cluster still change the registry; the router's start-up check reads the host Serve binds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from rayrunner.runtime import ray_private
from tests.conftest import Service, model_entry

USER = "inference-key-789"


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {"models": [model_entry("tiny", tiny_llama_dir, load=False)],
              "state_path": str(cluster["state_dir"] / "admin-keys.json"), "auth": {"api_keys": [USER]}}
    svc = Service(cluster, config)
    yield svc
    svc.close()


@pytest.mark.parametrize(("path", "body"), [("/v1/models/aliases", {"model_id": "tiny", "alias": "t"}),
                                            ("/v1/models/remove", {"model_id": "tiny"}),
                                            ("/v1/models/unload", {"model_id": "tiny"})])
def test_an_inference_key_on_an_admin_route_is_403_saying_the_admin_api_is_off(
        service: Service, path: str, body: dict[str, Any]) -> None:
    headers = {"authorization": f"Bearer {USER}"}
    refused = service.http.post(path, json=body, headers=headers)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "permission_denied" and "no admin API keys" in error["message"]
    assert USER not in refused.text
    assert service.http.post(path, json=body).status_code == 401
    models = service.http.get("/v1/models", headers=headers)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["tiny"]  # nothing changed


def test_handles_inside_the_cluster_still_use_the_admin_api(service: Service) -> None:
    service.handle.add_alias.remote("tiny", "tiny-alias").result(timeout_s=60)
    card = service.http.get("/v1/models/tiny-alias", headers={"authorization": f"Bearer {USER}"})
    assert card.status_code == 200 and card.json()["id"] == "tiny"


def test_the_router_start_check_sees_the_host_serve_binds(service: Service) -> None:
    assert asyncio.run(ray_private.serve_http_host()) == "127.0.0.1"  # the test cluster's Serve
