"""The OpenAI features clients rely on, through the real openai SDK against SmolLM2 (bf16, the shipped config's
model) on a real cluster: logprobs, n, structured output, tool calls, tool results in the history, echo scoring."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrunner.engines.loading import load_model
from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.models.spec import build_spec
from tests.conftest import Service

MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "calm"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "mood", "hobbies"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                       "required": ["city"], "additionalProperties": False},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


@pytest.fixture(scope="module")
def client(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _plain_logprobs(*sequences: list[int]) -> list[torch.Tensor]:
    """For each of `sequences`, one forward pass of SmolLM2 loaded in this process as its replica loads it (bf16,
    with the replica's CPU matmul choices): the log-softmax at each position (it scores the next token)."""
    spec = build_spec(MODEL, {"type": "plain", "model_id": SMOLLM2})
    model = load_model(spec, AutoModelForCausalLM).model
    with torch.inference_mode():
        return [torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)
                for ids in sequences]


def test_greedy_logprobs_are_the_models(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=6, logprobs=True,
                                           top_logprobs=3, extra_body={"cache_salt": uuid.uuid4().hex})
    assert reply.usage.prompt_tokens_details.cached_tokens == 0  # a salt of its own: nothing reused, a whole prefill
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    assert all(e.top_logprobs[0].token == e.token and len(e.top_logprobs) == 3 for e in entries)
    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt + reply.choices[0].message.content, add_special_tokens=False)["input_ids"]
    start = len(ids) - len(entries)
    prompt_only, plain = _plain_logprobs(ids[:start], ids)
    # The first token comes from the prefill: this same forward pass over the prompt. Later ones come from cached
    # decode steps, whose bf16 rounding differs slightly from recomputing the whole sequence (measured: up to
    # 0.005; 1e-3 in float32, see tests/engines/test_choices_and_logprobs.py).
    assert abs(entries[0].logprob - float(prompt_only[-1, ids[start]])) < 1e-3
    for step, entry in enumerate(entries[1:], start=1):
        assert abs(entry.logprob - float(plain[start + step - 1, ids[start + step]])) < 0.01


def test_echo_scores_the_prompt(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="The capital of France is Paris", max_tokens=0,
                                      echo=True, logprobs=1)
    logprobs = reply.choices[0].logprobs
    assert reply.choices[0].text == "The capital of France is Paris"
    assert logprobs.token_logprobs[0] is None and all(lp < 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens) == "The capital of France is Paris"


def test_n_gives_indexed_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, n=3, temperature=1.0,
                                           seed=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content for c in reply.choices)
    streamed = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, n=2, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 16


def test_sampled_json_schema_replies_all_validate(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(seed: int) -> str:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], temperature=1.0,
            seed=seed, max_tokens=160, response_format=fmt)  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(6) as pool:  # many more samples in process: engines/test_constrained.py
        replies = list(pool.map(ask, range(6)))
    for text in replies:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(replies)) > 1


def _check_call(call: Any, name: str, tools: list[dict[str, Any]]) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_plain_and_streamed(client: openai.OpenAI, choice: Any) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "What's the weather in Paris?"}],
           "tools": [WEATHER, TIME], "tool_choice": choice, "max_tokens": 80}
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
    calls = reply.choices[0].message.tool_calls
    assert calls
    if choice != "required":
        _check_call(calls[0], "get_weather", [WEATHER, TIME])
    for call in calls:
        _check_call(call, call.function.name, [WEATHER, TIME])
    pieces: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for delta_call in chunk.choices[0].delta.tool_calls or []:
            piece = pieces.setdefault(delta_call.index, {"name": "", "arguments": ""})
            piece["name"] += delta_call.function.name or ""
            piece["arguments"] += delta_call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and pieces
    assert [json.loads(p["arguments"]) for p in pieces.values()] == [json.loads(c.function.arguments) for c in calls]


def test_tool_results_in_the_history_round_trip(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What's the weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=60)
    call = first.choices[0].message.tool_calls[0]
    history = [
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=30)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.choices[0].message.content
    assert reply.choices[0].message.tool_calls is None


def test_unsupported_schema_feature_is_a_400_naming_it(client: openai.OpenAI) -> None:
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})  # type: ignore[arg-type]
    assert "uniqueItems" in str(caught.value)


def _completion_tokens(client: openai.OpenAI, chat: bool, stream: bool, **extra: Any) -> tuple[int, str]:
    """One request's completion tokens and finish reason, with vLLM's `extra` fields as the SDK sends them."""
    common: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "extra_body": extra}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if chat:
        result: Any = client.chat.completions.create(messages=QUESTION, stream=stream, **common)
    else:
        result = client.completions.create(prompt="The capital of France is", stream=stream, **common)
    if not stream:
        return result.usage.completion_tokens, result.choices[0].finish_reason
    chunks = list(result)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks[-1].usage.completion_tokens, reasons[-1]


def test_benchmark_length_fields_fix_the_reply_length(client: openai.OpenAI) -> None:
    """What `vllm bench serve`, aiperf and guidellm send to fix output lengths (the greedy answer alone ends after
    about 8 tokens): `ignore_eos` runs to max_tokens, `min_tokens` holds EOS back."""
    cases = [(chat, stream, extra) for chat in (True, False) for stream in (False, True)
             for extra in ({"ignore_eos": True}, {"min_tokens": 40})]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _completion_tokens(client, case[0], case[1], **case[2]), cases))
    for (chat, stream, extra), (tokens, reason) in zip(cases, results, strict=True):
        if "ignore_eos" in extra:
            assert (tokens, reason) == (64, "length"), (chat, stream)
        else:
            assert tokens >= 40, (chat, stream)
