"""A reply's text as tool calls: the model's own format (auto) parsed whole and streamed, a forced call's JSON."""

from __future__ import annotations

import json

from rayrunner.openai.tool_calls import ToolFormat
from rayrunner.openai.tool_replies import ToolReplies
from rayrunner.protocol import ChatCompletionRequest

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _request(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_no_tools_or_tool_choice_none_means_plain_content() -> None:
    assert ToolReplies.of(_request(), ToolFormat.HERMES) is None
    assert ToolReplies.of(_request(tools=[TOOL], tool_choice="none"), ToolFormat.HERMES) is None


def test_auto_parses_the_models_format_whole_and_streamed() -> None:
    replies = ToolReplies.of(_request(tools=[TOOL]), ToolFormat.HERMES)
    assert replies is not None and not replies.forced
    content, calls = replies.split(HERMES)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]
    stream = replies.stream()
    deltas = [d for i in range(0, len(HERMES), 5) for d in stream.feed(HERMES[i:i + 5])] + stream.finish()
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    pieces = [c for d in deltas for c in d.tool_calls or []]
    assert [(p.index, (p.function or {})["name"]) for p in pieces] == [(0, "get_weather")] and stream.calls == 1


def test_forced_json_is_read_at_the_end_and_bad_json_stays_content() -> None:
    replies = ToolReplies.of(_request(tools=[TOOL], tool_choice="required"), ToolFormat.HERMES)
    assert replies is not None and replies.forced
    stream = replies.stream()
    assert stream.feed('[{"name": "get_weather", ') == []
    deltas = stream.feed('"arguments": {"city": "Oslo"}}]') + stream.finish()
    assert [d.tool_calls[0].function for d in deltas if d.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"}'}]
    assert replies.split('{"name": "get_weather", "argu') == ('{"name": "get_weather", "argu', [])
