"""Tool-call parsing: every format whole and streamed in any chunking gives the same content and calls, marker text
is never released as content before it is known, malformed calls stay content; forced-call schemas validate."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from rayrunner.errors import InvalidRequestError
from rayrunner.openai.tool_calls import (
    MAX_FORCED_CALLS,
    ParsedCall,
    ToolCallStream,
    ToolFormat,
    forced_call_schema,
    parse_forced_calls,
    parse_tool_calls,
    tool_format,
)
from rayrunner.protocol import NamedToolChoice, Tool, ToolCallDelta

H, L, M = ToolFormat.HERMES, ToolFormat.LLAMA, ToolFormat.MISTRAL
G, C = ToolFormat.GRANITE, ToolFormat.COHERE
HA, OL = ToolFormat.HARMONY, ToolFormat.OLMO
WEATHER = {"city": "Paris", "unit": "c"}

# (format, output, content, [(name, arguments)])
CASES: list[tuple[ToolFormat, str, str | None, list[tuple[str, dict[str, Any]]]]] = [
    (H, '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     None, [("weather", WEATHER)]),
    (H, 'Let me look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "time", "arguments": {"tz": "}</tool_call>"}}\n</tool_call>',
     "Let me look.", [("weather", WEATHER), ("time", {"tz": "}</tool_call>"})]),
    (H, 'a<tool_call>{"name": "f", "arguments": {}}</tool_call>b', "ab", [("f", {})]),
    (H, '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}', None, [("f", {"x": 1})]),  # unclosed at the end
    (H, '<tool_call>[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]</tool_call>',
     None, [("f", {"a": 1}), ("g", {})]),
    (H, "x < y and <tool_ is not a call <tool_call", "x < y and <tool_ is not a call <tool_call", []),
    (H, "No tools needed.\n", "No tools needed.\n", []),
    (H, "", None, []),
    (L, '{"name": "weather", "parameters": {"city": "Paris", "unit": "c"}}', None, [("weather", WEATHER)]),
    (L, '<|python_tag|>{"name": "f", "parameters": {"s": "a\\"}"}}; {"name": "g", "parameters": {}}',
     None, [("f", {"s": 'a"}'}), ("g", {})]),
    (L, '  {"name": "f", "arguments": {"n": [1, {"k": null}]}}\nDone.', "Done.", [("f", {"n": [1, {"k": None}]})]),
    (L, 'Here: {"name": "f", "parameters": {}}', 'Here: {"name": "f", "parameters": {}}', []),
    (L, 'Thinking <|python_tag|>{"name": "f", "parameters": {"a": 1}}', "Thinking", [("f", {"a": 1})]),
    (M, '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "g", "arguments": {}}]', None, [("weather", WEATHER), ("g", {})]),
    (M, 'Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"q": "[TOOL_CALLS]"}}]', "Sure.",
     [("f", {"q": "[TOOL_CALLS]"})]),
    (M, "[TOOL_ maybe [TOOL", "[TOOL_ maybe [TOOL", []),
    (G, 'Checking.<|tool_call|>[{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}]', "Checking.",
     [("weather", WEATHER)]),
    (C, 'I will look it up.\n<|START_ACTION|>[\n  {"tool_call_id": "0", "tool_name": "weather", "parameters": '
        '{"city": "Paris", "unit": "c"}},\n  {"tool_call_id": "1", "tool_name": "g", "parameters": {}}\n]'
        "<|END_ACTION|>", "I will look it up.", [("weather", WEATHER), ("g", {})]),
    (M, '[TOOL_CALLS]weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]g[ARGS]{}', None,
     [("weather", WEATHER), ("g", {})]),
    (M, 'On it.[TOOL_CALLS]weather[CALL_ID]a1b2c3d4e[ARGS] {"city": "Paris", "unit": "c"}', "On it.",
     [("weather", WEATHER)]),
    (HA, '<|channel|>analysis<|message|>Need the weather.<|start|>assistant<|channel|>commentary '
         'to=functions.weather <|constrain|>json<|message|>{"city": "Paris", "unit": "c"}<|call|>',
     "Need the weather.", [("weather", WEATHER)]),
    (HA, '<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{}', None, [("g", {})]),
    (HA, "<|channel|>final<|message|>It is sunny.", "It is sunny.", []),
    (OL, 'Let me check.<function_calls>weather(city="Paris", unit="c")\ng(n=-1, on=true, x=None, l=[1, {"k": null}])'
        "</function_calls>", "Let me check.",
     [("weather", WEATHER), ("g", {"n": -1, "on": True, "x": None, "l": [1, {"k": None}]})]),
    (OL, "<function_calls>[weather(city='Paris', unit='c'), g()]</function_calls>", None,
     [("weather", WEATHER), ("g", {})]),
    (OL, '<function_calls>[{"name": "weather", "arguments": {"city": "Paris", "unit": "c"}}]</function_calls>', None,
     [("weather", WEATHER)]),
]

MALFORMED = [
    (H, "<tool_call>not json</tool_call>"),
    (H, '<tool_call>{"name": "f", "arguments": {}</tool_call>'),  # unbalanced
    (H, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (H, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments not an object
    (H, '<tool_call>{"name": "f", "arguments": "nope"}</tool_call>'),
    (H, '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut short
    (L, '{"answer": 42}'),
    (L, "{not json at all"),
    (M, '[TOOL_CALLS]{"name": "f", "arguments": {}}'),  # not an array
    (M, "[TOOL_CALLS][]"),
    (M, '[TOOL_CALLS][{"name": "f", "arguments": {}}, 3]'),
    (G, '<|tool_call|>{"name": "f", "arguments": {}}'),  # not an array
    (C, '<|START_ACTION|>[{"tool_call_id": "0", "parameters": {}}]<|END_ACTION|>'),  # no tool_name
    (M, '[TOOL_CALLS]f[ARGS][1]'),  # arguments not an object
    (M, "[TOOL_CALLS]f(x) [ARGS]{}"),
    (HA, '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": 1'),  # cut short
    (HA, '<|channel|>commentary to=functions.f<|message|>"x"'),
    (OL, "<function_calls>f(1, 2)</function_calls>"),  # positional arguments
    (OL, "<function_calls>f(x=open('/etc'))</function_calls>"),  # not a literal
    (OL, "<function_calls>import os</function_calls>"),
    (OL, "<function_calls>f(x=1"),  # cut short
]
MARKERS = ["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "<|tool_call|>",
           "<|START_ACTION|>", "<|END_ACTION|>", "<|channel|>", "<|message|>", "<function_calls>"]


def calls_of(calls: list[ParsedCall]) -> list[tuple[str, dict[str, Any]]]:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def run_stream(fmt: ToolFormat, chunks: list[str]) -> tuple[str | None, list[ParsedCall], list[ToolCallDelta]]:
    """Feeds the chunks; returns the content released, the calls and their streamed deltas."""
    stream = ToolCallStream(fmt)
    content, deltas = "", []
    for chunk in chunks:
        for piece in stream.feed(chunk):
            if isinstance(piece, str):
                content += piece
            else:
                deltas.append(piece)
    for piece in stream.finish():
        if isinstance(piece, str):
            content += piece
        else:
            deltas.append(piece)
    return content or None, stream.calls, deltas


def chunkings(text: str) -> list[list[str]]:
    every_split = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    rng = random.Random(len(text))
    randoms = []
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        randoms.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return [*every_split, *randoms, list(text)]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_output_gives_content_and_calls(fmt: ToolFormat, text: str, content: str | None,
                                              calls: list[tuple[str, dict[str, Any]]]) -> None:
    got_content, got_calls = parse_tool_calls(text, fmt)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(call.id.startswith("call_") for call in got_calls)
    assert len({call.id for call in got_calls}) == len(got_calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_any_chunking_streams_the_same_and_never_leaks_a_marker(
        fmt: ToolFormat, text: str, content: str | None, calls: list[tuple[str, dict[str, Any]]]) -> None:
    for chunks in chunkings(text):
        got_content, got_calls, deltas = run_stream(fmt, chunks)
        assert got_content == content, chunks
        assert calls_of(got_calls) == calls, chunks
        assert [d.index for d in deltas] == list(range(len(calls)))
        assert [(d.id, d.type, d.function) for d in deltas] == [
            (c.id, "function", {"name": c.name, "arguments": c.arguments}) for c in got_calls]
        if calls:
            assert not any(marker in (got_content or "") for marker in MARKERS)


@pytest.mark.parametrize(("fmt", "text"), MALFORMED)
def test_malformed_calls_stay_content(fmt: ToolFormat, text: str) -> None:
    assert parse_tool_calls(text, fmt) == (text, [])
    for chunks in chunkings(text):
        assert run_stream(fmt, chunks)[:2] == (text, [])


def test_a_possible_marker_is_held_until_known() -> None:
    stream = ToolCallStream(H)
    assert stream.feed("Checking <tool_") == ["Checking"]
    assert stream.feed("call>\n{\"name\": \"f\", ") == []
    assert stream.feed('"arguments": {}}\n</tool') == []
    delta, content = stream.feed("_call>\nok")
    assert isinstance(delta, ToolCallDelta) and delta.function == {"name": "f", "arguments": "{}"}
    assert (content, stream.finish()) == ("ok", [])

    stream = ToolCallStream(H)
    assert stream.feed("a <tool_") == ["a"]
    assert stream.feed("box> b") == [" <tool_box> b"]

    stream = ToolCallStream(L)
    assert stream.feed('{"answer": ') == []
    assert "".join(str(p) for p in stream.feed("42}") + stream.finish()) == '{"answer": 42}'


def test_tool_format_from_the_chat_template(smollm2_template: str) -> None:
    assert tool_format(None) is H
    assert tool_format(smollm2_template) is H
    assert tool_format("{% for tool in tools %}<tool_call>{{ tool | tojson }}{% endfor %}") is H
    assert tool_format('{{- "<|python_tag|>" }}{"name": function name, "parameters": ...}') is L
    assert tool_format('{{ "[TOOL_CALLS]" + tool_calls | tojson }}') is M
    assert tool_format('{{ "[TOOL_CALLS]" + name + "[ARGS]" + arguments }}') is M
    assert tool_format('{{- "<|start|>assistant to=functions." + name + "<|channel|>commentary json<|message|>" }}'
                       '{"parameters": ') is HA
    assert tool_format("{{- '<function_calls>' + name + '(' + arguments + ')' + '</function_calls>' }}") is OL


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    from transformers import AutoTokenizer

    from rayrunner.models.sources import SMOLLM2, resolve

    return str(AutoTokenizer.from_pretrained(resolve(SMOLLM2).path).chat_template)


TOOLS = [
    Tool.model_validate({"function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}),
    Tool.model_validate({"function": {"name": "book", "parameters": {
        "type": "object", "properties": {"slot": {"$ref": "#/$defs/Slot"}}, "required": ["slot"],
        "$defs": {"Slot": {"type": "object", "properties": {"day": {"type": "string"}}, "required": ["day"]}}}}}),
]
WEATHER_CALL = {"name": "weather", "arguments": {"city": "Paris"}}
BOOK_CALL = {"name": "book", "arguments": {"slot": {"day": "mon"}}}


def valid(schema: dict[str, Any], value: Any) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_required_schema_accepts_calls_of_any_tool_in_an_array_when_parallel() -> None:
    schema = forced_call_schema(TOOLS, "required", parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert valid(schema, [WEATHER_CALL, BOOK_CALL])
    assert not valid(schema, [])
    assert not valid(schema, [WEATHER_CALL] * (MAX_FORCED_CALLS + 1))
    assert not valid(schema, [{"name": "book", "arguments": {"slot": {}}}])  # through the hoisted $ref
    assert not valid(schema, [{"name": "weather", "arguments": {"unit": "c"}}])
    assert not valid(schema, [{"name": "other", "arguments": {}}])
    assert not valid(schema, WEATHER_CALL)

    single = forced_call_schema(TOOLS, "required", parallel=False)
    assert valid(single, BOOK_CALL) and not valid(single, [BOOK_CALL])


def test_named_schema_accepts_only_that_function() -> None:
    schema = forced_call_schema(TOOLS, NamedToolChoice.model_validate({"function": {"name": "weather"}}), False)
    assert valid(schema, WEATHER_CALL)
    assert not valid(schema, BOOK_CALL)
    assert not valid(schema, {"name": "weather"})
    with pytest.raises(InvalidRequestError):
        forced_call_schema(TOOLS, NamedToolChoice.model_validate({"function": {"name": "nope"}}), False)


def test_forced_output_parses_back() -> None:
    for value in (WEATHER_CALL, [WEATHER_CALL, BOOK_CALL]):
        calls = parse_forced_calls(json.dumps(value))
        expected = value if isinstance(value, list) else [value]
        assert calls_of(calls) == [(v["name"], v["arguments"]) for v in expected]
    assert parse_forced_calls('[{"name": "weather", "arguments": {"ci') == []
