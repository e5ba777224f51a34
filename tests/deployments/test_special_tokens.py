"""Special tokens in a reply's text, through the text engine on a tiny model whose tokenizer has Mistral's
`[TOOL_CALLS]` as a special token: an `auto` tool call in that format is parsed (the marker must survive
detokenization), other replies skip special tokens unless `skip_special_tokens` is false.

The model is random, so its output is scripted by a logits processor in the place of the request's grammar: the
forward passes, detokenization and response shaping are the engine's own."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrunner.deployments import responses
from rayrunner.deployments.sampling_params import LogitsProcessor, sampling_params
from rayrunner.deployments.text_engine import TextEngine
from rayrunner.models.spec import build_spec
from rayrunner.protocol import ChatCompletionRequest

MARKER = "[TOOL_CALLS]"
# Mistral's layout, reduced: tools offered before the last user turn, calls written after `[TOOL_CALLS]`.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]{{ message['content'] }}[/INST]"
    "{% elif message['tool_calls'] %}[TOOL_CALLS]{{ message['tool_calls'] | tojson }}{{ eos_token }}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TextEngine]:
    folder = tmp_path_factory.mktemp("tiny-mistral")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tokenizer.add_tokens([MARKER], special_tokens=True)
    tokenizer.chat_template = TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    engine = TextEngine(build_spec("tiny-mistral", {"type": "plain", "model_id": str(Path(folder))}))
    yield engine
    engine.close()


def _scripted(engine: TextEngine, text: str) -> Callable[[], LogitsProcessor]:
    """A processor factory that makes each sequence write `text`, then EOS."""
    ids = [*engine.tokenizer(text, add_special_tokens=False)["input_ids"], min(engine.eos_ids)]

    def processor(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))
        forced[ids[min(len(output), len(ids) - 1)]] = 0.0
        return forced

    return lambda: processor


async def _reply(engine: TextEngine, monkeypatch: pytest.MonkeyPatch, text: str, **fields: Any) -> Any:
    monkeypatch.setattr(engine, "_constraint", lambda request: _scripted(engine, text))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40,
                                    **fields)
    events = engine.chat(request, sampling_params(request, engine.spec.engine))
    return await responses.chat_response("m", events, request, engine.tool_replies(request))


async def _chunks(engine: TextEngine, monkeypatch: pytest.MonkeyPatch, text: str, **fields: Any) -> list[Any]:
    monkeypatch.setattr(engine, "_constraint", lambda request: _scripted(engine, text))
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=40,
                                    stream=True, **fields)
    events = engine.chat(request, sampling_params(request, engine.spec.engine))
    return [c async for c in responses.chat_chunks("m", events, request, engine.tool_replies(request))]


async def test_a_mistral_auto_tool_call_is_parsed(engine: TextEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    assert engine.tokenizer.added_tokens_decoder[engine.tokenizer.convert_tokens_to_ids(MARKER)].special
    choice = (await _reply(engine, monkeypatch, CALL, tools=[WEATHER])).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    chunks = await _chunks(engine, monkeypatch, CALL, tools=[WEATHER])
    streamed = [call for c in chunks for ch in c.choices for call in ch.delta.tool_calls or []]
    assert [(s.function or {})["name"] for s in streamed] == ["get_weather"]
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices)


async def test_other_replies_skip_special_tokens_unless_asked(engine: TextEngine,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    plain = (await _reply(engine, monkeypatch, CALL)).choices[0].message.content
    assert plain == ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    kept = (await _reply(engine, monkeypatch, CALL, skip_special_tokens=False)).choices[0].message.content
    assert kept == CALL
