"""The Python API on a real cluster: mistral.rs's multi-model example step by step, a second Runner for the same
model, the same operations through a DeploymentHandle, wrong use, and many threads sharing one Runner."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from PIL import Image

from rayrunner import (
    Architecture,
    ChatCompletionRequest,
    ModelAlreadyUnloadedError,
    ModelExistsError,
    ModelLoadError,
    ModelNotFoundError,
    MultiModelBuilder,
    Runner,
    Which,
)
from tests.tiny_models import build_tiny_llava, image_data_url


@pytest.fixture(scope="module")
def runner(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Runner]:
    from tests.conftest import cleanup_serve

    made = Runner(which=Which.Plain(model_id=tiny_llama_dir), in_situ_quant="Q8_0", model_id="text-a",
                  state_path=str(cluster["state_dir"] / "runner.json"))
    yield made
    made.shutdown()
    cleanup_serve()


def ask(content: str, **extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": content}], max_tokens=6, **extra)


def test_multi_model_example_step_by_step(runner: Runner, tiny_llama_dir: str, tmp_path: Any) -> None:
    # Construct with Which + in_situ_quant: loaded, quantized, default.
    assert runner.list_models() == ["text-a"]
    assert runner.list_models_with_status() == [("text-a", "loaded")]
    assert runner.get_default_model_id() == "text-a"
    assert runner.model_card("text-a")["info"]["quantization"]["requested"] == "Q8_0"

    # A second model, then default get/set.
    runner.add_model("text-b", Which.Plain(model_id=tiny_llama_dir), aliases=("b",))
    runner.set_default_model_id("b")
    assert runner.get_default_model_id() == "text-b"
    assert runner.is_model_loaded("text-a") and runner.is_model_loaded("text-b")

    # Unload then reload, with the status at each step.
    runner.unload_model("text-a")
    assert runner.get_model_status("text-a") == "unloaded"
    assert runner.list_unloaded_models() == ["text-a"]
    assert runner.list_models() == ["text-b"]
    runner.reload_model("text-a")
    assert runner.get_model_status("text-a") == "loaded"
    assert runner.model_card("text-a")["info"]["quantization"]["requested"] == "Q8_0"  # same ISQ after reload

    # Unary and streaming requests to a chosen model; None routes to the default.
    reply = runner.send_chat_completion_request(ask("hello"))
    assert reply.model == "text-b" and reply.usage.completion_tokens == 6
    chunks = list(runner.send_chat_completion_request(ask("hello", stream=True), model_id="text-a"))
    assert chunks[0].model == "text-a" and chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == runner.send_chat_completion_request(ask("hello"), model_id="text-a").choices[0].message.content

    # A multimodal model beside the text ones.
    llava = build_tiny_llava(tmp_path / "llava")
    runner.add_model("vision", Which.MultimodalPlain(model_id=llava))
    content = [{"type": "text", "text": "What is this?"},
               {"type": "image_url", "image_url": {"url": image_data_url(Image.new("RGB", (32, 32), "red"))}}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": content}], max_tokens=4)
    answer = runner.send_chat_completion_request(request, model_id="vision")
    assert answer.model == "vision" and answer.usage.completion_tokens >= 1
    runner.remove_model("vision")
    assert "vision" not in dict(runner.list_models_with_status())

    # Pinned (never evicted to make room) and back, saved in the registry.
    runner.pin_model("b")
    assert runner.model_card("text-b")["pinned"] is True
    runner.unpin_model("text-b")
    assert not runner.model_card("text-b")["pinned"]

    # Replica settings, saved (text-a is unloaded: they apply at its next load).
    runner.unload_model("text-a")
    runner.scale_model("text-a", routing="prefix")
    assert runner.model_card("text-a")["spec"]["engine"]["routing"] == "prefix"
    with pytest.raises(ValueError, match="num_replicas"):
        runner.scale_model("text-a", num_replicas=0)


def test_a_second_runner_for_the_same_model_attaches_to_it(runner: Runner, tiny_llama_dir: str) -> None:
    """As mistral.rs's example does: a new `Runner(which=...)` per function, in one process, none shut down."""
    which = Which.Plain(model_id=tiny_llama_dir)
    again = Runner(which=which, in_situ_quant="Q8_0", model_id="text-a")
    assert again.is_model_loaded("text-a")
    loads = again.model_card("text-a")["load_count"]
    again.unload_model("text-a")
    Runner(which=which, in_situ_quant="Q8_0", model_id="text-a")  # attaches, and loads it again
    assert runner.is_model_loaded("text-a") and runner.model_card("text-a")["load_count"] == loads + 1
    with pytest.raises(ModelExistsError, match=r"different spec \(in_situ_quant: 'Q8_0' -> 'Q4K'\)"):
        Runner(which=which, in_situ_quant="Q4K", model_id="text-a")
    for _ in range(2):
        built = (MultiModelBuilder().add_model(which, in_situ_quant="Q8_0", model_id="text-a")
                 .add_model_with_alias("a", which, in_situ_quant="Q8_0", load=False).build())
    assert built.model_card("a")["model_id"] == tiny_llama_dir
    assert built.model_card("text-a")["spec"]["in_situ_quant"] == "Q8_0"
    built.remove_model(tiny_llama_dir)


def test_runners_with_other_specs_of_one_model_each_hold_their_own(runner: Runner, tiny_llama_dir: str) -> None:
    """mistral.rs's examples make `Runner(which=X)` and later `Runner(which=X, in_situ_quant=...)` in one script:
    each gets exactly its model; the second lives beside the first under an id derived from its spec."""
    plain = Runner(which=Which.Plain(model_id=tiny_llama_dir))
    quantized = Runner(which=Which.Plain(model_id=tiny_llama_dir, arch=Architecture.Llama), in_situ_quant="Q8_0")
    variant = f"{tiny_llama_dir}@Q8_0"
    assert plain.list_models() == [tiny_llama_dir] and quantized.list_models() == [variant]
    assert quantized.get_default_model_id() == variant and plain.get_default_model_id() == tiny_llama_dir
    assert quantized.send_chat_completion_request(ask("hi")).model == variant  # no model_id: the Runner's own
    assert quantized.send_chat_completion_request(ask("hi"), model_id=tiny_llama_dir).model == variant
    assert quantized.model_card(tiny_llama_dir)["spec"]["in_situ_quant"] == "Q8_0"
    assert plain.model_card(tiny_llama_dir)["spec"]["in_situ_quant"] is None
    again = Runner(which=Which.Plain(model_id=tiny_llama_dir, arch=Architecture.Llama), in_situ_quant="Q8_0")
    assert again.list_models() == [variant]  # the same spec attaches to the same variant
    quantized.unload_model(tiny_llama_dir)  # its own variant; the plain model stays
    assert plain.is_model_loaded(tiny_llama_dir) and not quantized.is_model_loaded(tiny_llama_dir)
    assert plain.send_chat_completion_request(ask("hi")).model == tiny_llama_dir
    assert again.send_chat_completion_request(ask("hi")).model == variant  # reloaded on request
    assert ("text-a", "loaded") in Runner.connect(address=None).list_models_with_status()  # connect: service-wide
    plain.remove_model(tiny_llama_dir)
    quantized.remove_model(variant)


def test_wrong_use_raises_documented_errors(runner: Runner, tiny_llama_dir: str) -> None:
    with pytest.raises(ModelNotFoundError, match="model `nope` was not found"):
        runner.unload_model("nope")
    with pytest.raises(ValueError, match="not found"):
        runner.send_chat_completion_request(ask("hi"), model_id="nope")
    runner.add_model("spare", Which.Plain(model_id=tiny_llama_dir), load=False)
    with pytest.raises(ModelAlreadyUnloadedError, match="already unloaded"):
        runner.unload_model("spare")
    with pytest.raises(ModelLoadError, match="expects model_type `qwen3`"):
        runner.add_model("wrong-arch", Which.Plain(model_id=tiny_llama_dir, arch=Architecture.Qwen3))
    assert runner.get_model_status("wrong-arch") == "unloaded"
    with pytest.raises(ValueError, match="Q4K"):
        runner.add_model("bad-isq", Which.Plain(model_id=tiny_llama_dir), in_situ_quant="Q7X")
    runner.remove_model("wrong-arch")
    runner.remove_model("spare")


def test_sixteen_threads_share_one_runner(runner: Runner) -> None:
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda i: runner.send_chat_completion_request(ask(f"say {i}"), model_id="text-a"),
                                range(16)))
    assert len(replies) == 16 and all(r.choices[0].message.content is not None for r in replies)


def test_deployment_handle_offers_the_same_operations(runner: Runner) -> None:
    from ray import serve

    handle = serve.get_app_handle("rayrunner")
    statuses = {c["model_id"]: c["status"] for c in handle.list_models.remote().result()}
    assert statuses["text-a"] == "loaded"
    handle.unload_model.remote("text-a").result()
    assert handle.get_model_status.remote("text-a").result() == "unloaded"
    body = {"model": "text-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply = handle.chat.remote(body).result()  # auto-reloads
    assert reply["model"] == "text-a" and handle.get_model_status.remote("text-a").result() == "loaded"
    chunks = list(handle.options(stream=True).chat_stream.remote(body))
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    handle.set_default_model_id.remote("text-a").result()
    assert handle.get_default_model_id.remote().result() == "text-a"
    with pytest.raises(Exception, match="model `ghost` was not found"):
        handle.reload_model.remote("ghost").result()


def test_runner_and_handle_carry_the_openai_fields(runner: Runner) -> None:
    """n, logprobs, a forced tool call and a JSON schema through Runner's request classes and a handle's dicts (a
    random-weight model may spell the forced JSON a character per token and fill every whitespace gap: room for it)."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"],
        "additionalProperties": False}}}  # else a random model may write extra keys of any length
    reply = runner.send_chat_completion_request(ask("hi", n=2, logprobs=True, top_logprobs=2), model_id="text-a")
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(len(c.logprobs.content) == 6 for c in reply.choices if c.logprobs)
    called = runner.send_chat_completion_request(
        ChatCompletionRequest(messages=[{"role": "user", "content": "look up x"}], max_tokens=400,
                              tools=[tool], tool_choice="required", parallel_tool_calls=False), model_id="text-a")
    assert called.choices[0].finish_reason == "tool_calls"
    assert called.choices[0].message.tool_calls[0].function.name == "lookup"
    from ray import serve

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    body = {"model": "text-a", "messages": [{"role": "user", "content": "a number"}], "max_tokens": 200,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    text = serve.get_app_handle("rayrunner").chat.remote(body).result()["choices"][0]["message"]["content"]
    assert 0 <= json.loads(text)["n"] <= 9
