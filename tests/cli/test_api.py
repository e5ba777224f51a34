"""The CLI's HTTP client without a server: SSE parsing, error messages and the API key header."""

from __future__ import annotations

import json

import httpx
import pytest

from rayrunner.cli.api import Api, CliError, error_message, parse_sse


def frames(*events: object) -> list[str]:
    lines = []
    for event in events:
        lines += [f"data: {event if isinstance(event, str) else json.dumps(event)}", ""]
    return lines


def test_events_up_to_done() -> None:
    chunk = {"choices": [{"delta": {"content": "hi"}}]}
    assert list(parse_sse([": keep-alive", *frames(chunk, chunk, "[DONE]")])) == [chunk, chunk]


def test_an_error_event_mid_stream_raises_its_message_after_the_events_before_it() -> None:
    chunk = {"choices": [{"delta": {"content": "hi"}}]}
    error = {"error": {"message": "model `m` is unavailable", "type": "server_error", "code": "model_unavailable"}}
    seen = []
    with pytest.raises(CliError) as raised:
        for event in parse_sse(frames(chunk, error, "[DONE]")):
            seen.append(event)
    assert seen == [chunk]
    assert raised.value.message == "model `m` is unavailable"


def test_a_stream_cut_before_done_raises() -> None:
    with pytest.raises(CliError, match="ended before"):
        list(parse_sse(frames({"choices": []})))


def test_error_message_reads_the_openai_body_or_says_what_came_back() -> None:
    request = httpx.Request("GET", "http://host/v1/models")
    body = {"error": {"message": "model `x` was not found", "type": "invalid_request_error"}}
    assert error_message(httpx.Response(404, json=body, request=request)) == "model `x` was not found"
    other = httpx.Response(502, text="<html>Bad   gateway</html>", request=request)
    assert error_message(other) == "HTTP 502 from http://host/v1/models: <html>Bad gateway</html>"


def test_the_api_key_goes_in_a_bearer_header_only_when_set() -> None:
    with_key, without = Api("http://host", "sk-123"), Api("http://host/")
    assert with_key._http.build_request("GET", "/v1/models").headers["authorization"] == "Bearer sk-123"
    assert "authorization" not in without._http.build_request("GET", "/v1/models").headers
    assert without.url == "http://host"
