"""Constrained decoding for `response_format`: the processor on SmolLM2's tokenizer (masks, EOS at the end of the
JSON, bounded whitespace, refused schemas), then sampled replies through a real TextEngine that all validate."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch

from rayrunner.deployments.constrained import Grammars
from rayrunner.deployments.sampling import SamplingParams
from rayrunner.deployments.text_engine import TextEngine
from rayrunner.errors import InvalidRequestError
from rayrunner.protocol import ChatCompletionRequest, ResponseFormat
from rayrunner.spec import build_spec

# Bounded on purpose (maxLength, maxItems, integer bounds, few keys): a reply that runs out of max_tokens is cut
# mid-JSON, so the schema must always fit in the engine tests' 120 tokens (replies here take ~40-70).
EMPLOYEE = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "skills"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smollm2() -> Iterator[TextEngine]:
    torch.set_num_threads(2)
    engine = TextEngine(build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct"}))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def grammars(smollm2: TextEngine) -> Grammars:
    return Grammars(smollm2.tokenizer, smollm2.eos_ids, smollm2.model.config.vocab_size)


def _ids(engine: TextEngine, text: str) -> list[int]:
    return list(engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _allowed(processor: Any, output: list[int], width: int = 49152) -> set[int]:
    logits = processor([], output, torch.zeros(width))
    return set(torch.nonzero(logits > float("-inf")).flatten().tolist())


def test_each_token_of_valid_json_is_allowed_and_only_eos_follows_the_end(smollm2: TextEngine,
                                                                          grammars: Grammars) -> None:
    text = json.dumps({"name": "Ada", "age": 36, "role": "engineer", "skills": ["maths", "poetry"]})
    ids = _ids(smollm2, text)
    processor = grammars.json_schema(EMPLOYEE)()
    for i, token in enumerate(ids):
        assert token in _allowed(processor, ids[:i]), smollm2.tokenizer.decode(ids[: i + 1])
    assert _allowed(processor, ids) == smollm2.eos_ids


def test_forbidden_tokens_are_masked_and_eos_waits_for_a_complete_value(smollm2: TextEngine,
                                                                        grammars: Grammars) -> None:
    processor = grammars.json_schema(EMPLOYEE)()
    first = _allowed(processor, [])
    assert first and all(smollm2.tokenizer.decode([t]).startswith("{") for t in first)
    prefix = _ids(smollm2, '{"name": "Ada", "age": ')
    after = _allowed(processor, prefix)
    assert after and not after & smollm2.eos_ids  # 18..99 or a little more whitespace: nothing else
    assert all(re.fullmatch(r"\s+|\s*[1-9]\d?", smollm2.tokenizer.decode([t])) for t in after)
    number = grammars.json_schema({"type": "integer"})()
    assert smollm2.eos_ids < _allowed(number, _ids(smollm2, "42"))  # could end here, or go on with digits


def test_sequences_of_one_request_each_get_their_own_matcher(smollm2: TextEngine, grammars: Grammars) -> None:
    factory = grammars.json_object()
    first, second = factory(), factory()
    _allowed(first, _ids(smollm2, '{"a": 1}'))
    assert _allowed(first, _ids(smollm2, '{"a": 1}')) == smollm2.eos_ids
    assert _allowed(second, []) == _allowed(factory(), [])


def test_model_vocabulary_past_the_tokenizer_is_never_allowed(smollm2: TextEngine) -> None:
    wide = Grammars(smollm2.tokenizer, smollm2.eos_ids, 49152 + 64)
    processor = wide.json_object()()
    assert max(_allowed(processor, [], 49152 + 64)) < 49152


@pytest.mark.parametrize("prefix", ["{", '{"a":', '{"a": [1,'])
def test_whitespace_between_json_tokens_is_capped(smollm2: TextEngine, grammars: Grammars, prefix: str) -> None:
    """A model that prefers whitespace above all still writes at most 16 whitespace characters in a gap, then has
    to go on with the JSON (inside strings whitespace is content, and is not capped)."""
    blank = [i for i in range(49152) if smollm2.tokenizer.decode([i]).isspace()]
    processor = grammars.json_object()()
    output = _ids(smollm2, prefix)
    for _ in range(20):
        logits = torch.zeros(49152)
        logits[blank] = 10.0
        output.append(int(torch.argmax(processor([], output, logits))))
    gap = smollm2.tokenizer.decode(output)[len(prefix):]
    assert re.match(r"\s{16}\S", gap), repr(gap)


def test_a_refused_token_ends_the_reply(smollm2: TextEngine, grammars: Grammars) -> None:
    processor = grammars.json_object()()
    assert _allowed(processor, _ids(smollm2, "hello")) == smollm2.eos_ids


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
    ({"type": "strng"}, "strng"),
    ({"$ref": "#/$defs/missing"}, "missing"),
    ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum"),
])
def test_a_schema_it_cannot_enforce_is_a_400_naming_why(grammars: Grammars, schema: dict[str, Any],
                                                        named: str) -> None:
    with pytest.raises(InvalidRequestError, match=named) as caught:
        grammars.json_schema(schema)
    assert caught.value.param == "response_format" and caught.value.status == 400


def test_response_format_picks_the_constraint(grammars: Grammars) -> None:
    assert grammars.for_response_format(None) is None
    assert grammars.for_response_format(ResponseFormat(type="text")) is None
    assert grammars.for_response_format(ResponseFormat(type="json_object")) is not None
    fmt = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "e", "schema": EMPLOYEE}})
    assert grammars.for_response_format(fmt) is not None
    with pytest.raises(InvalidRequestError, match="uniqueItems"):
        grammars.for_response_format(ResponseFormat.model_validate(
            {"type": "json_schema", "json_schema": {"schema": {"type": "array", "uniqueItems": True}}}))


async def _replies(engine: TextEngine, grammars: Grammars, prompt: str, fmt: dict[str, Any],
                   seeds: range) -> list[tuple[str, str | None]]:
    """Sampled replies (temperature 1, one seed each), all in one batch. The request carries `response_format`
    and its params the matching constraint, so this holds whether or not the engine derives it from the request."""
    request = ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], response_format=fmt)

    async def reply(seed: int) -> tuple[str, str | None]:
        constraint = grammars.for_response_format(request.response_format)
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, constraint=constraint)
        events = [event async for event in engine.chat(request, params)]
        return "".join(e.text for e in events), events[-1].finish_reason

    return await asyncio.gather(*(reply(seed) for seed in seeds))


async def test_twenty_sampled_replies_all_validate(smollm2: TextEngine, grammars: Grammars) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "employee", "schema": EMPLOYEE}}
    prompt = "Describe a fictional employee as JSON with name, age, role and skills."
    for text, reason in await _replies(smollm2, grammars, prompt, fmt, range(20)):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), EMPLOYEE)


async def test_json_object_replies_parse_to_objects(smollm2: TextEngine, grammars: Grammars) -> None:
    """Any JSON object has no bound: a prompt that asks for a small one keeps the replies well inside max_tokens."""
    prompt = "What is the capital of France? Answer as a JSON object with the keys country and capital."
    for text, reason in await _replies(smollm2, grammars, prompt, {"type": "json_object"}, range(4)):
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)
