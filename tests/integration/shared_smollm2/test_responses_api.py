"""`POST /v1/responses` end to end: the openai SDK's `client.responses.create`, plain and streamed, against a real
router and SmolLM2 on a real cluster."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import Service

QUESTION = "What is the capital of France?"
INSTRUCTIONS = "You are a geography teacher. Answer in one sentence."
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(service: Service) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{service.url}/v1", api_key="x", max_retries=0)


def test_create_answers_like_the_chat_endpoint(service: Service, client: Any) -> None:
    response = client.responses.create(model="smol", input=QUESTION, instructions=INSTRUCTIONS,
                                       max_output_tokens=40, temperature=0)
    chat = service.http.post("/v1/chat/completions", json={
        "model": "smol", "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]}).json()
    assert response.output_text == chat["choices"][0]["message"]["content"]  # the instructions led as system
    assert response.id.startswith("resp_") and response.status == "completed"
    assert response.model == "smollm2-135m-instruct" and response.instructions == INSTRUCTIONS
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"] > 0


def test_stream_deltas_join_to_the_completed_text(client: Any) -> None:
    unary = client.responses.create(model="smol", input=QUESTION, max_output_tokens=40).output_text
    events = list(client.responses.create(model="smol", input=QUESTION, max_output_tokens=40, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert len(deltas) >= 3
    completed = events[-1].response
    assert "".join(deltas) == completed.output_text == unary and "Paris" in unary
    assert completed.id == events[0].response.id and completed.usage.output_tokens > 0
    with client.responses.stream(model="smol", input=QUESTION, max_output_tokens=40) as helper:  # the SDK's own
        assert helper.get_final_response().output_text == unary  # accumulator accepts the events


def test_stream_over_raw_http_names_each_event(service: Service) -> None:
    with service.http.stream("POST", "/v1/responses", json={"input": QUESTION, "max_output_tokens": 3,
                                                             "stream": True}) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    payloads = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [payload["type"] for payload in payloads] and "[DONE]" not in lines
    assert names[-1] == "response.incomplete"
    assert payloads[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_output_token_limit_makes_it_incomplete(client: Any) -> None:
    response = client.responses.create(model="smol", input=QUESTION, max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output_text


def test_function_call_history_is_sent_to_the_model(client: Any) -> None:
    response = client.responses.create(model="smol", tools=[WEATHER_TOOL], max_output_tokens=30, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 degrees Celsius."},
    ])
    assert response.status in ("completed", "incomplete") and response.usage.input_tokens > 20
    assert response.tools[0].name == "get_weather"


def test_json_schema_format_constrains_the_output(client: Any) -> None:
    response = client.responses.create(model="smol", input="Name the capital of France and its country.",
                                       max_output_tokens=60, text={"format": {
                                           "type": "json_schema", "name": "city", "schema": CITY_SCHEMA,
                                           "strict": True}})
    assert response.text.format.type == "json_schema"
    answer = json.loads(response.output_text)
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())


def test_forced_tool_choice_returns_a_function_call(client: Any) -> None:
    asked = {"model": "smol", "input": "What is the weather in Paris?", "tools": [WEATHER_TOOL],
             "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 60}
    response = client.responses.create(**asked)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert set(json.loads(calls[0].arguments)) == {"city"}
    events = list(client.responses.create(**asked, stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    final = [item for item in events[-1].response.output if item.type == "function_call"]
    assert events[-1].type == "response.completed" and added[0].name == "get_weather"
    assert deltas == done == final[0].arguments and set(json.loads(done)) == {"city"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_stateful_and_unsupported_fields_are_a_400(client: Any, fields: dict[str, Any], param: str) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as caught:
        client.responses.create(model="smol", input=QUESTION, **fields)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["param"] == param and error["code"] == "invalid_request"
    if param in ("previous_response_id", "background"):
        assert "stateless" in error["message"]


def test_unknown_model_is_a_404_before_the_stream_starts(service: Service) -> None:
    reply = service.http.post("/v1/responses", json={"model": "nope", "input": "hi", "stream": True})
    assert reply.status_code == 404 and reply.json()["error"]["code"] == "model_not_found"


def test_handle_methods(service: Service) -> None:
    body = {"model": "smol", "input": QUESTION, "max_output_tokens": 5}
    response = service.handle.responses.remote(body).result()
    assert response["object"] == "response" and response["output"][0]["content"][0]["text"]
    events = list(service.handle.options(stream=True).responses_stream.remote(body))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.incomplete"


def test_openapi_describes_the_request(service: Service) -> None:
    spec = service.http.get("/openapi.json").json()
    schema = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/ResponsesRequest"}
    fields = spec["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert {"input", "instructions", "tools", "text", "max_output_tokens", "previous_response_id"} <= set(fields)
