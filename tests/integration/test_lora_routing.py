"""A LoRA model registered beside its base is served by the base's replica: no replica of its own, replies as the
adapter, requests for base and adapter interleave without a reload, and it loads and unloads with its base."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from ray import serve
from transformers import AutoModelForCausalLM

from rayrunner.models.sources import SMOLLM2, resolve
from tests.conftest import Service, model_entry

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    folder = tmp_path_factory.mktemp("lora")
    base = AutoModelForCausalLM.from_pretrained(resolve(SMOLLM2).path, dtype=torch.bfloat16)
    get_peft_model(base, config).save_pretrained(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], adapter: str) -> Iterator[Service]:
    # float32: the random adapter's garbled reply has near-ties between tokens, which bf16 rounding inside a padded
    # batch can flip on some CPUs; the interleaving test compares replies word for word
    lora = {"spec": {"model_id": "smol-lora", "which": {"type": "lora", "model_id": SMOLLM2, "adapter": adapter,
                                                         "dtype": "f32"}},
            "aliases": [], "load": True}
    base = model_entry("smol", SMOLLM2, load=False)
    base["spec"]["which"]["dtype"] = "f32"
    # the base is `load: false`: the LoRA model's `load: true` loads it (its replica serves the adapter)
    config = {"models": [base, lora],
              "state_path": str(cluster["state_dir"] / "lora.json")}
    svc = Service(cluster, config)
    yield svc
    svc.close()


def answer(service: Service, model: str) -> dict[str, Any]:
    response = service.chat(QUESTION, model=model, max_tokens=10)
    assert response.status_code == 200, response.text
    return dict(response.json())


def pid(service: Service) -> int:
    return int(service.handle.model_card.remote("smol").result()["info"]["pid"])


def test_a_lora_model_to_load_loads_its_host(service: Service) -> None:
    deadline = time.monotonic() + 300
    while service.handle.model_card.remote("smol").result()["status"] != "loaded":  # no request needed
        assert time.monotonic() < deadline, "the host of a `load: true` LoRA model never loaded"
        time.sleep(0.5)


def test_the_lora_model_is_served_by_its_bases_replica(service: Service) -> None:
    base, tuned = answer(service, "smol"), answer(service, "smol-lora")  # (waits for the base's first load)
    card = service.handle.model_card.remote("smol-lora").result()
    assert card["served_by"] == "smol" and card["status"] == "loaded"
    assert "smol-lora" not in serve.status().applications  # no replica of its own
    assert tuned["model"] == "smol-lora" and base["model"] == "smol"
    assert tuned["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]


def test_base_and_adapter_requests_interleave_without_a_reload(service: Service) -> None:
    before = pid(service)
    alone = {m: answer(service, m)["choices"][0]["message"]["content"] for m in ("smol", "smol-lora")}
    with ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda i: answer(service, ["smol", "smol-lora"][i % 2]), range(6)))
    assert [r["choices"][0]["message"]["content"] for r in replies] == [alone["smol"], alone["smol-lora"]] * 3
    assert pid(service) == before


def test_it_unloads_and_reloads_with_its_base(service: Service) -> None:
    assert service.http.post("/v1/models/unload", json={"model_id": "smol-lora"}).status_code == 200
    assert service.card("smol")["status"] == "unloaded" and service.card("smol-lora")["status"] == "unloaded"
    assert answer(service, "smol-lora")["model"] == "smol-lora"  # reloads the base, which loads the adapter again
    assert service.card("smol")["status"] == "loaded"
