"""The Responses API mapping, without Ray: requests to chat bodies, chat answers and chunks to Responses objects and
events, each checked against the openai SDK's own types."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rayrunner.errors import InvalidRequestError, ModelUnavailableError
from rayrunner.protocol import ChatCompletionRequest
from rayrunner.router.app import parsed
from rayrunner.router.responses_api import ResponsesRequest, event_frames, stream_events, to_chat_request, to_response

TOOL = {"type": "function", "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def request(**fields: Any) -> ResponsesRequest:
    return parsed(ResponsesRequest, {"input": "hi", **fields})


def chat_body(**fields: Any) -> dict[str, Any]:
    """The chat body for a Responses request, checked to be a valid ChatCompletionRequest."""
    body = to_chat_request(request(**fields))
    ChatCompletionRequest.model_validate(body)
    return body


def test_string_input_is_one_user_message_and_instructions_lead_as_system() -> None:
    assert chat_body()["messages"] == [{"role": "user", "content": "hi"}]
    body = chat_body(instructions="Be brief.", model="smol", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert (body["model"], body["max_tokens"], body["temperature"], body["top_p"]) == ("smol", 7, 0.5, 0.9)
    assert "model" not in chat_body(model=None)  # the chat default applies


def test_message_items_with_text_and_image_parts() -> None:
    image = "data:image/png;base64,AAAA"
    body = chat_body(input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is "},
                                                         {"type": "input_text", "text": "this?"}]},
        {"role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "A cat.", "annotations": []}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And this?"},
                                     {"type": "input_image", "image_url": image, "detail": "low"}]},
    ])
    assert body["messages"] == [
        {"role": "developer", "content": "Rules."},
        {"role": "user", "content": "What is this?"},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": [{"type": "text", "text": "And this?"},
                                     {"type": "image_url", "image_url": {"url": image, "detail": "low"}}]},
    ]


def test_function_call_history_becomes_tool_calls_and_tool_messages() -> None:
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    second = {**call, "call_id": "call_2", "arguments": '{"city": "Rome"}', "id": "fc_2", "status": "completed"}
    body = chat_body(tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Let me check."},
        call, second,
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ])
    assert body["messages"][1:] == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    ]
    alone = chat_body(input=[{"role": "user", "content": "?"}, call])["messages"][1]
    assert alone["role"] == "assistant" and alone["content"] is None and len(alone["tool_calls"]) == 1


def test_tools_and_tool_choice_take_the_chat_shape() -> None:
    body = chat_body(tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)
    function = {key: value for key, value in TOOL.items() if key != "type"}
    assert body["tools"] == [{"type": "function", "function": function}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["parallel_tool_calls"] is False
    assert chat_body(tools=[TOOL], tool_choice="required")["tool_choice"] == "required"
    assert "tools" not in chat_body(tools=[])


@pytest.mark.parametrize(
    ("text_format", "response_format"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, {"type": "json_object"}),
        ({"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True},
         {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"}, "strict": True}}),
    ],
)
def test_text_format_becomes_response_format(text_format: dict[str, Any], response_format: Any) -> None:
    body = chat_body(text={"format": text_format, "verbosity": "low"})
    assert body.get("response_format") == response_format


def test_stream_asks_for_usage_and_ignored_fields_are_accepted() -> None:
    body = chat_body(stream=True, metadata={"k": "v"}, user="u", store=True, reasoning={"effort": "low"},
                     background=False)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "stream_options" not in chat_body()


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
        ({"background": True}, "background", "stateless"),
        ({"conversation": "conv_1"}, "conversation", "stateless"),
        ({"tools": [{"type": "web_search"}, {"type": "file_search"}, TOOL]}, "tools", "`file_search`, `web_search`"),
        ({"tool_choice": {"type": "web_search"}}, "tool_choice", "`web_search`"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", "`reasoning`"),
        ({"input": []}, "input", "must not be empty"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input", "image_url"),
        ({"text": {"format": {"type": "json_schema"}}}, "text", "`name` and `schema`"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ],
)
def test_unsupported_or_invalid_fields_are_a_400_naming_them(fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        request(**fields)
    assert caught.value.param == param and words in caught.value.message, caught.value.message


def chat(content: str | None, finish_reason: str = "stop", tool_calls: list[dict[str, Any]] | None = None
         ) -> dict[str, Any]:
    message = {"role": "assistant", "content": content, "tool_calls": tool_calls}
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "smollm2",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16, "avg_tok_per_sec": 3.0}}


def test_response_holds_the_text_usage_and_echoed_settings() -> None:
    asked = request(instructions="Be brief.", temperature=0.2, max_output_tokens=9, tools=[TOOL],
                    text={"format": {"type": "json_object"}}, metadata={"k": "v"})
    body = to_response(chat("Paris."), asked)
    response = Response.model_validate(body)
    assert response.id.startswith("resp_") and response.object == "response" and response.status == "completed"
    assert response.output_text == "Paris." and response.model == "smollm2"
    assert response.incomplete_details is None and response.error is None
    assert body["output"][0]["content"] == [{"type": "output_text", "text": "Paris.", "annotations": [],
                                             "logprobs": []}]
    assert body["output"][0]["id"].startswith("msg_") and body["output"][0]["role"] == "assistant"
    assert body["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                             "output_tokens": 5, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": 16}
    assert (body["instructions"], body["temperature"], body["max_output_tokens"]) == ("Be brief.", 0.2, 9)
    assert body["tools"] == [TOOL] and body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    assert body["text"] == {"format": {"type": "json_object"}} and body["metadata"] == {"k": "v"}
    assert to_response(chat("x"), request())["text"] == {"format": {"type": "text"}}


def test_length_finish_is_incomplete() -> None:
    body = to_response(chat("The capital", finish_reason="length"), request(max_output_tokens=2))
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert Response.model_validate(body).output_text == "The capital"


def test_tool_calls_become_function_call_items() -> None:
    calls = [{"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    body = to_response(chat(None, "tool_calls", calls), request(tools=[TOOL]))
    assert [item["type"] for item in body["output"]] == ["function_call"]
    item = body["output"][0]
    assert item["id"].startswith("fc_") and item["status"] == "completed"
    assert (item["call_id"], item["name"], item["arguments"]) == ("call_a", "get_weather", '{"city":"Oslo"}')
    with_text = to_response(chat("Checking.", "tool_calls", calls), request(tools=[TOOL]))
    assert [item["type"] for item in with_text["output"]] == ["message", "function_call"]
    Response.model_validate(with_text)
    assert Response.model_validate(to_response(chat(""), request())).output_text == ""


async def chunks(*deltas: dict[str, Any], finish: str = "stop", fail: Exception | None = None
                 ) -> AsyncIterator[dict[str, Any]]:
    """A chat stream as the model deployment sends it: role chunk, deltas, finish chunk, usage chunk."""
    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "smollm2",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    yield chunk({"role": "assistant", "content": ""})
    for delta in deltas:
        yield chunk(delta)
    if fail:
        raise fail
    yield chunk({}, finish)
    yield {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "smollm2", "choices": [],
           "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}


async def collect(stream: AsyncIterator[dict[str, Any]], asked: ResponsesRequest) -> list[dict[str, Any]]:
    events = [event async for event in stream_events(stream, asked)]
    for event in events:
        EVENTS.validate_python(event)  # each parses as the SDK's event type
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


async def test_text_stream_events_in_order() -> None:
    events = await collect(chunks({"content": "Par"}, {"content": "is"}, {"content": "."}), request(stream=True))
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]
    created, final = events[0]["response"], events[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"] == final["id"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Paris."
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id and e["output_index"] == 0 for e in events[3:9])
    assert events[2]["item"]["status"] == "in_progress" and events[9]["item"]["status"] == "completed"
    assert events[7]["text"] == "Paris." and final["output"] == [events[9]["item"]]
    assert Response.model_validate(final).output_text == "Paris." and final["usage"]["total_tokens"] == 7


async def test_stream_cut_by_the_token_limit_ends_incomplete() -> None:
    events = await collect(chunks({"content": "The"}, finish="length"), request(stream=True, max_output_tokens=1))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


async def test_tool_call_stream_events() -> None:
    def piece(index: int, **fields: Any) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, **fields}]}

    stream = chunks({"content": "Checking."},
                    piece(0, id="call_a", type="function", function={"name": "get_weather", "arguments": ""}),
                    piece(0, function={"arguments": '{"city":'}), piece(0, function={"arguments": '"Oslo"}'}),
                    piece(1, id="call_b", type="function", function={"name": "get_weather", "arguments": "{}"}),
                    finish="tool_calls")
    events = await collect(stream, request(stream=True, tools=[TOOL]))
    kinds = [event["type"] for event in events]
    assert kinds[2:] == [
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    first_call = events[8]["item"]
    assert (first_call["type"], first_call["call_id"], events[8]["output_index"]) == ("function_call", "call_a", 1)
    assert events[11]["arguments"] == '{"city":"Oslo"}' and events[11]["item_id"] == first_call["id"]
    final = events[-1]["response"]["output"]
    assert [item["type"] for item in final] == ["message", "function_call", "function_call"]
    assert [item.get("arguments") for item in final[1:]] == ['{"city":"Oslo"}', "{}"]


async def test_an_empty_answer_still_has_a_message_and_a_failure_is_an_error_event() -> None:
    empty = await collect(chunks(), request(stream=True))
    assert Response.model_validate(empty[-1]["response"]).output_text == ""
    failed = await collect(chunks({"content": "Pa"}, fail=ModelUnavailableError("smollm2")), request(stream=True))
    assert failed[-1]["type"] == "error" and failed[-1]["code"] == "model_unavailable"
    assert "unavailable" in failed[-1]["message"] and "response.completed" not in [e["type"] for e in failed]


async def test_frames_are_sse_with_event_names() -> None:
    async def two() -> AsyncIterator[dict[str, Any]]:
        yield {"type": "response.created", "sequence_number": 0}
        yield {"type": "error", "sequence_number": 1}

    frames = [frame async for frame in event_frames(two())]
    assert frames[0] == 'event: response.created\ndata: {"type": "response.created", "sequence_number": 0}\n\n'
    assert frames[1].startswith("event: error\ndata: ") and json.loads(frames[1].split("data: ")[1])["type"] == "error"


def test_keep_alive_reaches_the_chat_request() -> None:
    chat = to_chat_request(parsed(ResponsesRequest, {"model": "m", "input": "hi", "keep_alive": "5m"}))
    assert chat["keep_alive"] == "5m"
    assert parsed(ChatCompletionRequest, chat).keep_alive == "5m"
    assert "keep_alive" not in to_chat_request(parsed(ResponsesRequest, {"model": "m", "input": "hi"}))


def test_reasoning_user_and_logprobs_reach_the_chat_request() -> None:
    body = chat_body(reasoning={"effort": "none", "summary": "auto"}, user="u-7", top_logprobs=3)
    assert (body["reasoning_effort"], body["user"], body["logprobs"], body["top_logprobs"]) == ("none", "u-7", True, 3)
    included = chat_body(include=["message.output_text.logprobs", "reasoning.encrypted_content"])
    assert (included["logprobs"], included["top_logprobs"]) == (True, 0)
    plain = chat_body(reasoning={"summary": "auto"}, truncation="auto", max_tool_calls=2)
    assert not {"reasoning_effort", "logprobs", "top_logprobs", "user"} & set(plain)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"reasoning": {"effort": "extreme"}}, "reasoning"), ({"top_logprobs": 21}, "top_logprobs"),
     ({"truncation": "middle"}, "truncation"), ({"max_tool_calls": -1}, "max_tool_calls")],
)
def test_bad_values_of_the_mapped_fields_name_them(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        request(**fields)
    assert caught.value.param == param


LOGPROBS = {"content": [{"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114],
                         "top_logprobs": [{"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114]},
                                          {"token": "Lon", "logprob": -1.5, "bytes": None}]},
                        {"token": "is", "logprob": -0.1, "top_logprobs": []}]}


def test_response_echoes_the_mapped_settings_and_holds_the_logprobs() -> None:
    asked = request(reasoning={"effort": "low"}, top_logprobs=1, truncation="auto", max_tool_calls=3, user="u")
    answer = chat("Paris")
    answer["choices"][0]["logprobs"] = LOGPROBS
    body = to_response(answer, asked)
    response = Response.model_validate(body)
    assert response.reasoning is not None and response.reasoning.effort == "low"
    assert (response.top_logprobs, response.truncation, response.max_tool_calls, response.user) == (1, "auto", 3, "u")
    text = response.output[0].content[0]  # type: ignore[union-attr]
    assert [(lp.token, lp.bytes, lp.logprob) for lp in text.logprobs] == [("Par", [80, 97, 114], -0.5),
                                                                          ("is", [105, 115], -0.1)]
    assert [(alt.token, alt.bytes) for alt in text.logprobs[0].top_logprobs] == [("Par", [80, 97, 114]),
                                                                                 ("Lon", [76, 111, 110])]
    assert to_response(chat("x"), request())["truncation"] == "disabled"


async def test_streamed_logprobs_ride_on_their_deltas_and_the_done_events() -> None:
    async def stream() -> AsyncIterator[dict[str, Any]]:
        for text, entry in (("Par", LOGPROBS["content"][0]), ("is", LOGPROBS["content"][1])):
            yield {"id": "c", "model": "smollm2", "choices": [
                {"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": {"content": [entry]}}]}

    events = await collect(stream(), request(stream=True, top_logprobs=1))
    deltas = [event["logprobs"] for event in events if event["type"] == "response.output_text.delta"]
    assert [[lp["token"] for lp in logprobs] for logprobs in deltas] == [["Par"], ["is"]]
    done = next(event for event in events if event["type"] == "response.output_text.done")
    assert [lp["token"] for lp in done["logprobs"]] == ["Par", "is"]
    assert events[-1]["response"]["output"][0]["content"][0]["logprobs"] == done["logprobs"]
