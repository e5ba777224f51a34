"""The vllm backend on a CUDA GPU: two vLLM models share one GPU (each a half GPU and a 1 GiB KV cache), and sleep
uses vLLM's sleep mode, level 1 (weights to host memory, woken without reading them again) and level 2 (dropped).

Skipped without a GPU (none on the CI machine) or without `.venv-vllm` holding vLLM's CUDA build
(`bash scripts/install_vllm.sh` on the GPU host); run where one is lent: `pytest -m gpu tests/integration`.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Service
from tests.integration.test_vllm_backend import vllm_venv_ready

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs a CUDA GPU")]


def spec(model_id: str, sleep_level: int) -> dict[str, Any]:
    return {"model_id": model_id, "which": {"type": "plain", "model_id": "smollm2-135m-instruct"},
            "engine": {"backend": "vllm", "num_gpus": 0.5, "max_seq_len": 2048,
                       "vllm": {"kv_cache_bytes": 1 << 30, "sleep_level": sleep_level}}}


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any]) -> Iterator[Service]:
    vllm_venv_ready()
    config = {"models": [{"spec": spec("light-sleeper", 1), "load": True},
                         {"spec": spec("deep-sleeper", 2), "load": True}],
              "state_path": str(cluster["state_dir"] / "vllm-gpu.json")}
    svc = Service(cluster, config)
    for model in ("light-sleeper", "deep-sleeper"):
        svc.wait_loaded(model, timeout_s=600)
    yield svc
    svc.close()


def info(service: Service, model: str) -> dict[str, Any]:
    return dict(service.handle.model_card.remote(model).result()["info"])


def test_two_vllm_models_share_one_gpu(service: Service) -> None:
    for model in ("light-sleeper", "deep-sleeper"):
        reply = service.chat("What is the capital of France?", model=model, max_tokens=8)
        assert reply.status_code == 200, reply.text
        assert info(service, model)["device"] == "cuda"


@pytest.mark.parametrize("model", ["light-sleeper", "deep-sleeper"])
def test_sleep_levels_keep_the_replica_and_wake_with_the_same_answer(service: Service, model: str) -> None:
    before = service.chat("Name a colour.", model=model, max_tokens=8).json()["choices"][0]["message"]["content"]
    pid = info(service, model)["pid"]
    assert service.http.post("/v1/models/unload", json={"model_id": model, "mode": "sleep"}).status_code == 200
    after = service.chat("Name a colour.", model=model, max_tokens=8)
    assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] == before
    woken = info(service, model)
    assert woken["pid"] == pid and woken["last_wake_s"] < 30
