"""Models added at runtime over HTTP on a service with a restricted source policy (one local root, every hub
organisation, as the shipped config): what would run code or read past the roots is a 4xx naming the field and
registers nothing; a model within the policy loads, and its replica checks its sources again where it reads them."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Service


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: str) -> Path:
    """The one folder models added at runtime may load from, holding a copy of the tiny model."""
    folder = tmp_path_factory.mktemp("allowed")
    shutil.copytree(tiny_llama_dir, folder / "tiny")
    return folder


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], root: Path) -> Iterator[Service]:
    config = {"models": [], "state_path": str(cluster["state_dir"] / "runtime_add_policy.json"),
              "sources": {"local_roots": [str(root)], "hub_orgs": ["*"]}}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def add(service: Service, **body: Any) -> httpx.Response:
    return service.http.post("/v1/models/add", json=body)


def registered(service: Service) -> set[str]:
    return {m["id"] for m in service.http.get("/v1/models").json()["data"]}


TINY = {"type": "plain", "model_id": "{root}/tiny"}  # `{root}`: the allowed folder


@pytest.mark.parametrize(("which", "engine", "status", "param"), [
    (TINY, {"backend": "vllm", "vllm": {"engine_args": {"trust_remote_code": True}}}, 403,
     "engine.vllm.engine_args.trust_remote_code"),
    (TINY, {"backend": "vllm", "vllm": {"engine_args": {"model": "/etc"}}}, 403, "engine.vllm.engine_args.model"),
    (TINY, {"backend": "vllm", "vllm": {"python": "/bin/sh"}}, 403, "engine.vllm.python"),
    ({"type": "gguf", "quantized_model_id": "{root}/tiny", "quantized_filename": "../../etc/passwd"}, {}, 400,
     "which.quantized_filename"),
    ({"type": "plain", "model_id": "../tiny"}, {}, 403, "which.model_id"),  # not a hub id, whatever `hub_orgs`
    ({**TINY, "tokenizer_json": "/etc"}, {}, 403, "which.tokenizer_json"),
])
def test_a_runtime_add_that_would_run_code_or_read_elsewhere_is_refused(
        service: Service, root: Path, which: dict[str, str], engine: dict[str, Any], status: int, param: str) -> None:
    which = {key: value.replace("{root}", str(root)) for key, value in which.items()}
    refused = add(service, model_id="intruder", which=which, engine=engine, load=True)
    assert refused.status_code == status, refused.text
    assert refused.json()["error"]["param"] == param
    assert "intruder" not in registered(service)
    assert service.http.get("/v1/models/intruder").status_code == 404


def test_a_model_within_the_policy_loads_with_tuning_settings(service: Service, root: Path) -> None:
    engine = {"vllm": {"engine_args": {"max_num_seqs": 4, "seed": 1}}}
    added = add(service, model_id="tuned", which={"type": "plain", "model_id": str(root / "tiny")}, engine=engine)
    assert added.status_code == 201, added.text
    chat = service.chat("hi", model="tuned", max_tokens=2)
    assert chat.status_code == 200, chat.text
    assert service.http.post("/v1/models/remove", json={"model_id": "tuned"}).status_code == 200


def test_the_replica_checks_the_sources_again_where_it_reads_them(service: Service, root: Path,
                                                                  tmp_path: Path) -> None:
    """A folder allowed when the model was added is a link out of the root by the time a replica reads it: the load
    fails on the replica's own check, and nothing of the other folder is served."""
    outside = tmp_path / "outside"
    shutil.copytree(root / "tiny", outside)
    swapped = root / "swapped"
    shutil.copytree(root / "tiny", swapped)
    added = add(service, model_id="swapped", which={"type": "plain", "model_id": str(swapped)}, load=False)
    assert added.status_code == 201, added.text
    shutil.rmtree(swapped)
    swapped.symlink_to(outside)
    failed = service.http.post("/v1/models/reload", json={"model_id": "swapped"})
    assert failed.status_code >= 400 and "outside the local folders" in failed.json()["error"]["message"], failed.text
    assert service.card("swapped")["status"] == "unloaded"
    assert service.http.post("/v1/models/remove", json={"model_id": "swapped"}).status_code == 200
