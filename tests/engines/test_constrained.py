"""Constrained decoding for `response_format` and forced tool calls: the processor on SmolLM2's tokenizer (masks, EOS
at the end of the JSON, compact or capped whitespace, refused schemas), what structured_output.py makes of a request
(closed objects, bounded strings, arrays and free-form objects, the schema stated in the system message, each
switchable), then replies through a real TextEngine that all validate and end by themselves."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
from pydantic import ValidationError

from rayrunner.engines.transformers.constrained import Grammars
from rayrunner.engines.transformers.text import TextEngine
from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import build_spec
from rayrunner.openai.chat_prompt import render_chat
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.openai.structured_output import json_target
from rayrunner.protocol import ChatCompletionRequest

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
    engine = TextEngine(build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct", "dtype": "f32"}))
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
    factory = grammars.json_schema({"type": "object"})
    first, second = factory(), factory()
    _allowed(first, _ids(smollm2, '{"a": 1}'))
    assert _allowed(first, _ids(smollm2, '{"a": 1}')) == smollm2.eos_ids
    assert _allowed(second, []) == _allowed(factory(), [])


def test_model_vocabulary_past_the_tokenizer_is_never_allowed(smollm2: TextEngine) -> None:
    wide = Grammars(smollm2.tokenizer, smollm2.eos_ids, 49152 + 64)
    processor = wide.json_schema({"type": "object"})()
    assert max(_allowed(processor, [], 49152 + 64)) < 49152


@pytest.mark.parametrize("prefix", ["{", '{"a":', '{"a": [1,'])
def test_flexible_whitespace_between_json_tokens_is_capped(smollm2: TextEngine, grammars: Grammars,
                                                            prefix: str) -> None:
    """A model that prefers whitespace above all still writes at most 16 whitespace characters in a gap, then has
    to go on with the JSON (inside strings whitespace is content, and is not capped)."""
    blank = [i for i in range(49152) if smollm2.tokenizer.decode([i]).isspace()]
    processor = grammars.json_schema({"type": "object"}, compact=False)()
    output = _ids(smollm2, prefix)
    for _ in range(20):
        logits = torch.zeros(49152)
        logits[blank] = 10.0
        output.append(int(torch.argmax(processor([], output, logits))))
    gap = smollm2.tokenizer.decode(output)[len(prefix):]
    assert re.match(r"\s{16}\S", gap), repr(gap)


@pytest.mark.parametrize(("prefix", "starts"), [("{", "none"), ('{"a":', "space"), ('{"a": ', "none"),
                                               ('{"a": [1,', "space"), ('{"a": [1, ', "none")])
def test_compact_json_has_no_whitespace_but_its_separators(smollm2: TextEngine, grammars: Grammars, prefix: str,
                                                           starts: str) -> None:
    """Compact (the default) is JSON as `json.dumps` writes it: `", "` and `": "`, no newline or other space, so
    the `\\n\\n,\\n\\n` separators SmolLM2 wrote under flexible whitespace cannot happen."""
    processor = grammars.json_schema({"type": "object", "additionalProperties": {"type": "array"}})()
    allowed = [smollm2.tokenizer.decode([t]) for t in _allowed(processor, _ids(smollm2, prefix))]
    assert allowed and not any(blank in text for text in allowed for blank in ("\n", "\t", "  "))
    if starts == "space":
        assert all(text.startswith(" ") for text in allowed), allowed
    else:
        assert not any(text.startswith(" ") for text in allowed), allowed


def test_a_refused_token_ends_the_reply(smollm2: TextEngine, grammars: Grammars) -> None:
    processor = grammars.json_schema({"type": "object"})()
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


# ---------------------------------------------------------------- what a request's JSON answer must be

BOOK = {"properties": {"title": {"title": "Title", "type": "string"}, "author": {"title": "Author", "type": "string"},
                       "year": {"title": "Year", "type": "integer"}},
        "required": ["title", "author", "year"], "title": "Book", "type": "object"}  # pydantic's, as clients send it
BOOK_PROMPT = "Name a famous novel, its author and the year it was published. Answer in JSON."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _request(fmt: dict[str, Any] | None = None, prompt: str = BOOK_PROMPT, **fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": prompt}],
                                                 "response_format": fmt, **fields})


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _note(request: ChatCompletionRequest) -> str | None:
    target = json_target(request)
    assert target is not None
    return target.system_note


def _accepts(smollm2: TextEngine, grammars: Grammars, request: ChatCompletionRequest, text: str) -> bool:
    """Whether the request's grammar lets `text` through (whole or as the start of a longer answer)."""
    factory = grammars.for_target(json_target(request))
    assert factory is not None
    matcher = factory().matcher  # type: ignore[attr-defined]
    return all(matcher.consume_token(token) for token in _ids(smollm2, text))


def test_text_answers_have_no_constraint(grammars: Grammars) -> None:
    assert json_target(_request()) is None and json_target(_request({"type": "text"})) is None
    assert grammars.for_target(None) is None


def test_objects_with_properties_allow_no_other_keys_unless_the_schema_says(smollm2: TextEngine,
                                                                           grammars: Grammars) -> None:
    """Plain pydantic schemas and tool parameters set no `additionalProperties`: SmolLM2 wrote `"type": "function",
    "description": ...` into a forced call's arguments. Objects with `properties` are closed (OpenAI strict mode's
    rule), unless the schema says otherwise or the request switches it off."""
    extra = '{"title": "Emma", "author": "Jane Austen", "year": 1815, "genre"'
    assert not _accepts(smollm2, grammars, _request(_schema_format(BOOK)), extra)
    assert _accepts(smollm2, grammars, _request(_schema_format({**BOOK, "additionalProperties": True})), extra)
    assert _accepts(smollm2, grammars, _request(_schema_format(BOOK), structured_output_options={
        "strict_objects": False}), extra)
    call = {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    assert not _accepts(smollm2, grammars, _request(**call), '{"name": "get_weather", "arguments": {"city": "Paris", "')
    assert _accepts(smollm2, grammars, _request(**call), '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    # allOf members stay open: each would refuse the keys the others add
    both = {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]}
    assert _accepts(smollm2, grammars, _request(_schema_format(both)), '{"a": 1, "b": 2}')


def test_strings_and_arrays_without_bounds_get_the_defaults(smollm2: TextEngine, grammars: Grammars) -> None:
    """Runaway strings (`"A.A.A.A...`) and arrays (`"chicken", "chicken", ...`) end: 256 characters, 16 items,
    unless the schema sets its own bound (or a pattern, format, enum) or the request switches them off."""
    schema = {"type": "object", "properties": {"s": {"type": "string"}, "a": {"type": "array", "items": {
        "type": "integer"}}, "long": {"type": "string", "minLength": 300}}}
    fmt = _schema_format(schema)
    assert _accepts(smollm2, grammars, _request(fmt), '{"s": "' + "x" * 256 + '"')
    assert not _accepts(smollm2, grammars, _request(fmt), '{"s": "' + "x" * 257)
    assert _accepts(smollm2, grammars, _request(fmt), '{"long": "' + "x" * 300 + '"')  # its minLength wins
    assert _accepts(smollm2, grammars, _request(fmt), '{"a": [' + ", ".join(["1"] * 16) + "]")
    assert not _accepts(smollm2, grammars, _request(fmt), '{"a": [' + ", ".join(["1"] * 17))
    unbounded = _request(fmt, structured_output_options={"max_string_length": None, "max_array_items": None})
    assert _accepts(smollm2, grammars, unbounded, '{"s": "' + "x" * 400 + '", "a": [' + ", ".join(["1"] * 20) + "]")
    fixed = _request(fmt, structured_output_options={"max_string_length": 4})
    assert not _accepts(smollm2, grammars, fixed, '{"s": "xxxxx')


def test_free_objects_have_bounded_identifier_keys(smollm2: TextEngine, grammars: Grammars) -> None:
    """`json_object` on SmolLM2 looped `"1984": "1984", ...` and wrote keys like `", by Elizabeth..."`: a free-form
    object's keys are identifiers, at most 16 of them, its strings and arrays bounded (`free_objects: open` lifts
    it)."""
    fmt = {"type": "json_object"}
    assert _accepts(smollm2, grammars, _request(fmt), '{"title": "1984", "year": 1949, "tags": [{"a_1": null}]}')
    assert not _accepts(smollm2, grammars, _request(fmt), '{"1984"')
    assert not _accepts(smollm2, grammars, _request(fmt), '{"a b"')
    many = "{" + ", ".join(f'"k{i}": {i}' for i in range(17))
    assert not _accepts(smollm2, grammars, _request(fmt), many)
    assert not _accepts(smollm2, grammars, _request(fmt), '{"a": {"b": "' + "x" * 257)
    opened = _request(fmt, structured_output_options={"free_objects": "open"})
    assert _accepts(smollm2, grammars, opened, '{"1984": "1984", "a b": 1}')


def test_the_schema_is_stated_unless_a_message_quotes_its_keys() -> None:
    note = _note(_request(_schema_format(BOOK)))
    assert note == ('Reply with a JSON object that matches this JSON Schema:\n{"properties": {"title": {"type": '
                    '"string"}, "author": {"type": "string"}, "year": {"type": "integer"}}, "required": ["title", '
                    '"author", "year"], "type": "object"}')
    quoted = 'Answer like {"title": "...", "author": "...", "year": 1900}.'
    assert _note(_request(_schema_format(BOOK), prompt=quoted)) is None
    off = _request(_schema_format(BOOK), structured_output_options={"state_schema": False})
    assert _note(off) is None
    assert _note(_request({"type": "json_object"})) is None
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(300)}}
    assert _note(_request(_schema_format(huge))) is None



def test_a_forced_call_of_one_function_states_its_arguments() -> None:
    """pydantic-ai's output tool (`tool_choice: required`, one tool) ran away greedily with only the tools prompt."""
    assert _note(_request(tools=[WEATHER], tool_choice="required")) == (
        'Call get_weather. Its arguments are a JSON object that matches this JSON Schema:\n{"type": "object", '
        '"properties": {"city": {"type": "string"}}, "required": ["city"]}')
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    assert _note(_request(tools=[WEATHER, other], tool_choice="required")) is None
    named = {"type": "function", "function": {"name": "get_time"}}
    assert str(_note(_request(tools=[WEATHER, other], tool_choice=named))).startswith("Call get_time.")
    off = _request(tools=[WEATHER], tool_choice="required", structured_output_options={"state_schema": False})
    assert _note(off) is None


def test_the_note_joins_the_system_message(smollm2: TextEngine) -> None:
    tokenizer = smollm2.tokenizer
    user = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}]}).messages
    alone = render_chat(tokenizer, user, None, None, system_note="NOTE")
    assert alone.startswith("<|im_start|>system\nNOTE<|im_end|>")
    system = ChatCompletionRequest.model_validate({"messages": [{"role": "system", "content": "Be brief."},
                                                                {"role": "user", "content": "Hi"}]}).messages
    assert render_chat(tokenizer, system, None, None, system_note="NOTE").startswith(
        "<|im_start|>system\nBe brief.\n\nNOTE<|im_end|>")


def test_a_misspelt_option_is_refused() -> None:
    with pytest.raises(ValidationError, match="strict"):
        _request(_schema_format(BOOK), structured_output_options={"strict": False})
    with pytest.raises(ValidationError, match="whitespace"):
        _request(_schema_format(BOOK), structured_output_options={"whitespace": "pretty"})
    with pytest.raises(ValidationError, match="max_string_length"):
        _request(_schema_format(BOOK), structured_output_options={"max_string_length": 10**30})


def test_a_schema_error_names_the_field_it_came_from(grammars: Grammars) -> None:
    with pytest.raises(InvalidRequestError, match="uniqueItems") as caught:
        grammars.for_target(json_target(_request(_schema_format({"type": "array", "uniqueItems": True}))))
    assert caught.value.param == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(InvalidRequestError, match="uniqueItems") as caught:
        grammars.for_target(json_target(_request(tools=[tool], tool_choice="required")))
    assert caught.value.param == "tools"


# ---------------------------------------------------------------- replies through a real engine


async def _replies(engine: TextEngine, requests: list[ChatCompletionRequest], temperature: float = 1.0,
                   seeds: list[int | None] | None = None, max_tokens: int = 120) -> list[tuple[str, str | None]]:
    """Each request's reply (one seed each), all in one batch; the engine derives the constraint from it."""
    seeds = seeds or [None] * len(requests)

    async def reply(request: ChatCompletionRequest, seed: int | None) -> tuple[str, str | None]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        events = [event async for event in engine.chat(request, params)]
        return "".join(e.text for e in events), events[-1].finish_reason

    return await asyncio.gather(*(reply(request, seed) for request, seed in zip(requests, seeds, strict=True)))


@pytest.mark.slow
async def test_the_greedy_replies_that_ran_away_now_end(smollm2: TextEngine) -> None:
    """Greedy SmolLM2 looped `"1984"\\n\\n: "1984"\\n\\n,...` on this json_object request and ran to max_tokens
    inside a string (`"A.A.A.A...`) on the openai SDK's Book prompt (as vLLM does); with the defaults both end."""
    novel = _request({"type": "json_object"},
                     "Name one famous novel, with its author and the year it was published.")
    strict = {**BOOK, "additionalProperties": False}  # the openai SDK's `parse` sends this
    book = _request({"type": "json_schema", "json_schema": {"name": "Book", "schema": strict, "strict": True}})
    (loop, loop_end), (text, end) = await _replies(smollm2, [novel, book], temperature=0.0)
    assert loop_end == "stop" and isinstance(json.loads(loop), dict), loop
    assert end == "stop", text
    jsonschema.validate(json.loads(text), strict)


@pytest.mark.slow
async def test_sampled_replies_all_validate(smollm2: TextEngine) -> None:
    request = _request(_schema_format(EMPLOYEE), "Describe a fictional employee as JSON with name, age, role and "
                       "skills.")
    for text, reason in await _replies(smollm2, [request] * 10, seeds=list(range(10))):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), EMPLOYEE)


@pytest.mark.slow
async def test_json_object_replies_parse_to_objects(smollm2: TextEngine) -> None:
    request = _request({"type": "json_object"}, "What is the capital of France? Answer as a JSON object with the "
                       "keys country and capital.")
    for text, reason in await _replies(smollm2, [request] * 4, seeds=list(range(4))):
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------- budget-aware closing

CAT_PROMPT = "Describe a cat in JSON."
# What pydantic-ai 2.68's `Agent(output_type=Book)` sends by default (its tool output), with `tool_choice: required`
# and no max_tokens: one `final_result` tool whose parameters are the output type's strict schema.
PYDANTIC_BOOK = {"properties": {"title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
                 "required": ["title", "author", "year"], "type": "object", "additionalProperties": False}
FINAL_RESULT = {"type": "function", "function": {"name": "final_result", "parameters": PYDANTIC_BOOK, "strict": True,
                                                 "description": "The final response which ends this conversation"}}


def _closed_by_force(smollm2: TextEngine, grammars: Grammars, request: ChatCompletionRequest, text: str,
                     left: int) -> str:
    """`text` as output with `left` tokens of budget still to go, then a token a step until only EOS is allowed: the
    one the processor forces, or while it forces none the lowest id it allows (a model that takes whatever it may).
    The reply must fit the budget and end forced."""
    factory = grammars.for_target(json_target(request))
    assert factory is not None
    output = _ids(smollm2, text)
    budget = len(output) + left
    processor, forced = factory(budget), False
    allowed = _allowed(processor, output) - set(smollm2.eos_ids)
    while allowed:
        forced = len(allowed) == 1
        output.append(min(allowed))
        allowed = _allowed(processor, output) - set(smollm2.eos_ids)
    assert forced and len(output) <= budget, smollm2.tokenizer.decode(output)
    return str(smollm2.tokenizer.decode(output))


@pytest.mark.parametrize("text", ['{"cat": {"name": "Tom, the very long', '{"cat": [{"colour": "black"}, ',
                                  '{"name": "Tom", "likes": [[1, 2], ["fi', '{"cat": {"age": 3.'])
def test_near_the_end_of_the_budget_only_the_closing_is_allowed(smollm2: TextEngine, grammars: Grammars,
                                                                 text: str) -> None:
    closed = _closed_by_force(smollm2, grammars, _request({"type": "json_object"}, CAT_PROMPT), text, left=12)
    assert closed.startswith(text) and isinstance(json.loads(closed), dict), closed


def test_far_from_the_end_the_model_chooses(smollm2: TextEngine, grammars: Grammars) -> None:
    factory = grammars.for_target(json_target(_request({"type": "json_object"}, CAT_PROMPT)))
    assert factory is not None
    output = _ids(smollm2, '{"cat": {"name": "To')
    assert len(_allowed(factory(len(output) + 40), output)) > 1000
    assert len(_allowed(factory(None), output)) > 1000  # no budget: never forced


def test_a_schemas_missing_required_keys_are_written(smollm2: TextEngine, grammars: Grammars) -> None:
    strict = {**BOOK, "additionalProperties": False}
    request = _request({"type": "json_schema", "json_schema": {"name": "Book", "schema": strict, "strict": True}})
    closed = _closed_by_force(smollm2, grammars, request, '{"title": "Pride and Prejudice, a novel of', left=16)
    jsonschema.validate(json.loads(closed), strict)


def test_a_forced_call_cut_short_still_has_valid_arguments(smollm2: TextEngine, grammars: Grammars) -> None:
    """pydantic-ai's tool output: the call's arguments are closed into an instance of the output schema."""
    request = _request(tools=[FINAL_RESULT], tool_choice="required")
    closed = _closed_by_force(smollm2, grammars, request, '[{"name": "final_result", "arguments": {"title": "Du',
                              left=16)
    (call,) = smollm2.tool_replies(request).split(closed)[1]  # type: ignore[union-attr]
    assert call.name == "final_result"
    jsonschema.validate(json.loads(call.arguments), PYDANTIC_BOOK)


@pytest.mark.slow
async def test_json_object_replies_cut_by_max_tokens_still_parse(smollm2: TextEngine) -> None:
    """At temperature 1.0 a json_object reply about a cat ran past max_tokens inside a long string value; now every
    reply closes its JSON within the budget."""
    request = _request({"type": "json_object"}, CAT_PROMPT)
    batches = await asyncio.gather(*(_replies(smollm2, [request] * 3, seeds=[1, 2, 3], max_tokens=max_tokens)
                                     for max_tokens in (16, 40, 64)))
    for text, _ in (reply for batch in batches for reply in batch):
        assert isinstance(json.loads(text), dict), text


@pytest.mark.slow
async def test_forced_calls_cut_by_max_tokens_still_validate(smollm2: TextEngine) -> None:
    request = _request(tools=[FINAL_RESULT], tool_choice="required", prompt=BOOK_PROMPT)
    replies = smollm2.tool_replies(request)
    assert replies is not None
    for text, _ in await _replies(smollm2, [request] * 3, seeds=[1, 2, 3], max_tokens=32):
        content, calls = replies.split(text)
        assert content is None and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), PYDANTIC_BOOK)
