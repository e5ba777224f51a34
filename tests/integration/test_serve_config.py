"""`serve run serve_config.yaml` as users start it, then Runner.connect, the openai SDK, embeddings and a
multimodal model side by side on the same service; unloading the default; `serve run` of an edited config."""

from __future__ import annotations

import base64
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from PIL import Image

from rayrunner import ChatCompletionRequest, Runner, Which
from tests.conftest import cleanup_serve
from tests.tiny_models import build_tiny_llava, image_data_url

ROOT = Path(__file__).resolve().parents[2]


def wait_until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def shipped_config(state_path: Path) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    router = next(app for app in config["applications"] if app["name"] == "rayrunner")
    router["args"]["state_path"] = str(state_path)
    router["args"]["sources"]["local_roots"].append(tempfile.gettempdir())  # the tests' tiny models live there
    return config


def serve_run(config: dict[str, Any], folder: Path) -> subprocess.Popen[bytes]:
    import ray

    path = folder / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_cli = str(Path(sys.executable).parent / "serve")
    return subprocess.Popen([serve_cli, "run", "--address", ray.get_runtime_context().gcs_address, str(path)],
                            env={**os.environ}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def served(cluster: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    from ray import serve

    cleanup_serve()
    state_path = tmp_path_factory.mktemp("served") / "registry.json"
    processes = [serve_run(shipped_config(state_path), tmp_path_factory.mktemp("config"))]

    def running() -> bool:
        apps = serve.status().applications
        return all(name in apps and apps[name].status == "RUNNING"
                   for name in ("rayrunner", "smollm2-135m-instruct"))

    wait_until(running, 300, "serve run to bring every app up")
    yield {**cluster, "state_path": state_path, "processes": processes}
    for process in processes:
        process.send_signal(signal.SIGTERM)  # SIGTERM leaves the apps running; clean them up ourselves
        process.wait(timeout=60)
    cleanup_serve()


def test_runner_connects_lists_and_chats(served: dict[str, Any]) -> None:
    runner = Runner.connect()
    wait_until(lambda: runner.is_model_loaded("smollm2-135m-instruct"), 300, "SmolLM2 to load")
    statuses = dict(runner.list_models_with_status())
    assert statuses == {"smollm2-135m-instruct": "loaded", "all-minilm-l6-v2": "unloaded"}
    assert runner.get_default_model_id() == "smollm2-135m-instruct"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = runner.send_chat_completion_request(ChatCompletionRequest(messages=question, max_tokens=20))
    assert "Paris" in (reply.choices[0].message.content or "")


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def test_embeddings_through_the_openai_sdk(served: dict[str, Any]) -> None:
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=f"{served['http']}/v1", api_key="none")
    texts = ["A man is playing a guitar.", "Someone plays the guitar.", "The stock market fell sharply today."]
    result = client.embeddings.create(model="minilm", input=texts)  # auto-loads the unloaded model
    vectors = [d.embedding for d in result.data]
    assert len(vectors) == 3 and len(vectors[0]) == 384
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    encoded = client.embeddings.create(model="minilm", input=texts[0], encoding_format="base64")
    raw = base64.b64decode(str(encoded.data[0].embedding))
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(decoded) == 384 and max(abs(x - y) for x, y in zip(decoded, vectors[0], strict=True)) < 1e-4
    with pytest.raises(BadRequestError, match="embedding model"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(BadRequestError, match="text model"):
        client.embeddings.create(model="default", input="hi")


def test_text_embedding_and_multimodal_models_together(served: dict[str, Any], tmp_path: Path) -> None:
    import httpx

    runner = Runner.connect()
    runner.add_model("vision", Which.MultimodalPlain(model_id=build_tiny_llava(tmp_path / "llava")))
    loaded = set(runner.list_models())
    assert {"smollm2-135m-instruct", "all-minilm-l6-v2", "vision"} <= loaded
    http = httpx.Client(base_url=served["http"], timeout=300)

    def describe(url: str) -> Any:
        content = [{"type": "text", "text": "Describe the image."}, {"type": "image_url", "image_url": {"url": url}}]
        return http.post("/v1/chat/completions", json={"model": "vision", "max_tokens": 8,
                                                        "messages": [{"role": "user", "content": content}]})

    red = describe(image_data_url(Image.new("RGB", (32, 32), "red")))
    noise = describe(image_data_url(Image.effect_noise((32, 32), 120).convert("RGB")))
    assert red.status_code == 200 and noise.status_code == 200
    assert red.json()["choices"][0]["message"]["content"] != noise.json()["choices"][0]["message"]["content"]
    remote = describe("http://example.com/cat.png")
    assert remote.status_code == 400 and "remote image" in remote.json()["error"]["message"]
    text = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    embedding = http.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": "Hi"})
    assert text.status_code == 200 and embedding.status_code == 200
    runner.remove_model("vision")


def test_unloading_the_default_keeps_it_the_default(served: dict[str, Any]) -> None:
    """Seen: with the embedding model loaded, unloading SmolLM2 made it the default, and `default` chats got 400."""
    import httpx

    runner = Runner.connect()
    assert runner.is_model_loaded("all-minilm-l6-v2")  # loaded by the embeddings test above
    runner.unload_model("smollm2-135m-instruct")
    assert runner.get_default_model_id() == "smollm2-135m-instruct"
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    reply = httpx.post(f"{served['http']}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "smollm2-135m-instruct" and runner.is_model_loaded("smollm2-135m-instruct")


def test_serve_run_of_an_edited_config_takes_its_spec_and_default(served: dict[str, Any], tmp_path: Path) -> None:
    runner = Runner.connect()
    runner.set_default_model_id("minilm")  # a runtime default: kept while the config's default stays the same
    config = shipped_config(served["state_path"])
    smol = next(app for app in config["applications"] if app["name"] == "smollm2-135m-instruct")
    smol["args"]["engine"] = {"default_max_tokens": 3}  # the router's entry shares these args (a YAML anchor)
    router = next(app for app in config["applications"] if app["name"] == "rayrunner")
    router["args"]["default_model"] = "smollm2-135m-instruct"
    served["processes"].append(serve_run(config, tmp_path))

    def applied() -> bool:
        card = runner.model_card("smollm2-135m-instruct")
        return card["spec"]["engine"]["default_max_tokens"] == 3 and card["status"] == "loaded"

    wait_until(applied, 300, "the edited config to reach the registry")
    assert runner.get_default_model_id() == "smollm2-135m-instruct"
    question = ChatCompletionRequest(messages=[{"role": "user", "content": "What is the capital of France?"}])
    reply = runner.send_chat_completion_request(question)
    assert reply.usage.completion_tokens == 3  # the running replica has the config's spec
    runner.unload_model("smollm2-135m-instruct")
    reply = runner.send_chat_completion_request(question)
    assert reply.usage.completion_tokens == 3  # and so does the one the registry reloads
