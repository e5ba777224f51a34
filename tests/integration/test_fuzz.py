"""Fuzzing the live service over real HTTP: schemathesis generates valid and invalid requests for every operation
in `/openapi.json` and no answer may be a 5xx; then explicit bad bodies, each a 400 with an OpenAI-shaped error.

The service holds one tiny random Llama with `max_seq_len: 64`, so a generated huge `max_tokens` is refused and `n: 16`
finishes in moments, and it keeps the production source policy (builtin models only), so a generated `add` never
reads a random path. Admin operations are fuzzed too: generated ids do not name the model, so they answer 404/409/403.
Body-size limits and API keys are tested with the hardening work, not here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from tests.conftest import Service, model_entry

MODEL = "fuzz"
ERROR_KEYS = {"message", "type", "param", "code"}
MESSAGES = [{"role": "user", "content": "hi"}]
EXAMPLES = 6  # per operation and mode: ~15 operations x 2 modes x 6, a minute or two on a tiny model


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {
        "models": [model_entry(MODEL, tiny_llama_dir, max_seq_len=64, default_max_tokens=8)],
        "default_model": MODEL,
        "sources": {"local_roots": [], "hub_orgs": []},  # the production default, whatever the fixtures allow
        "state_path": str(cluster["state_dir"] / "fuzz.json"),
    }
    svc = Service(cluster, config)
    yield svc
    svc.close()


def assert_openai_error(response: Any, status: int | None = None) -> dict[str, Any]:
    """The body is `{"error": {message, type, param, code}}` with a message and a code; returns the error."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, response.text
    error: dict[str, Any] = body["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str), error
    assert status is None or response.status_code == status, (response.status_code, response.text)
    return error


def stream_errors(text: str) -> list[dict[str, Any]]:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    return [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]


def answer_problem(case: schemathesis.Case) -> str | None:
    """What is wrong with the service's answer to `case`: a 5xx, an error not OpenAI-shaped, or a stream carrying
    a server-side error."""
    response = case.call(timeout=120)
    what = f"{case.method} {case.formatted_path} {case.body!r:.300}: {response.status_code} {response.text[:300]}"
    if response.status_code >= 500:
        return what
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"not an OpenAI error: {what}"
        return None if set(error) == ERROR_KEYS else f"not an OpenAI error: {what}"
    streamed = str(response.headers.get("content-type", "")).startswith("text/event-stream")
    if streamed and any(e["type"] == "server_error" for e in stream_errors(response.text)):
        return f"server error in a stream: {what}"
    return None


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(service: Service, mode: GenerationMode) -> None:
    """Every operation of `/openapi.json`, EXAMPLES generated requests each (valid ones, then invalid ones). Run
    through hypothesis directly rather than schemathesis' pytest plugin, whose lazy schemas do not work on pytest 9;
    problems are collected, not raised, so one run lists every failing operation (and nothing is shrunk)."""
    api = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    problems: list[str] = []
    operations = [result.ok() for result in api.get_all_operations() if isinstance(result, Ok)]
    assert len(operations) >= 15  # the OpenAI API, the admin API, health

    for operation in operations:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case: schemathesis.Case) -> None:
            problem = answer_problem(case)
            if problem:
                problems.append(problem)

        try:
            check()
        except Unsatisfiable:  # a GET with nothing to break (no body, no query): no negative case exists
            assert mode == GenerationMode.NEGATIVE and operation.method.upper() == "GET", operation.path
    assert problems == [], "\n".join(problems)


def test_service_still_serves_after_the_fuzz(service: Service) -> None:
    response = service.chat("hi", max_tokens=2)
    assert response.status_code == 200, response.text
    assert [m["id"] for m in service.http.get("/v1/models").json()["data"]] == [MODEL]


LONG = "word " * 400  # ~400 tokens, over the model's 64


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -3}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1.5}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": "two"}, "n"),
        ("/v1/chat/completions", {"messages": MESSAGES, "stream": "maybe"}, "stream"),
        ("/v1/chat/completions", {"messages": MESSAGES, "model": 7}, "model"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": ""}, "prompt"),  # was a 500: a forward pass over no tokens
        ("/v1/completions", {"prompt": "", "stream": True}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/embeddings", {"input": {"text": "hi"}}, "input"),
        ("/v1/responses", {"input": []}, "input"),
        ("/v1/models/status", {"model_id": 5}, "model_id"),
        ("/v1/models/add", {"model_id": "x", "which": {"type": "teleport", "model_id": "y"}}, "which"),
        ("/v1/models/unload", {"model_id": MODEL, "mode": "hibernate"}, "mode"),
    ],
)
def test_wrong_values_and_types_are_a_400(service: Service, path: str, body: dict[str, Any],
                                          param: str | None) -> None:
    error = assert_openai_error(service.http.post(path, json=body), 400)
    assert param is None or error["param"] == param, error


@pytest.mark.parametrize("max_tokens", [65, 10**9, 2**70])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_max_tokens_over_the_context_is_a_400(service: Service, path: str, max_tokens: int) -> None:
    """The model's context is 64 tokens: a max_tokens above it can never be honoured."""
    response = service.http.post(path, json={"messages": MESSAGES, "prompt": "hi", "max_tokens": max_tokens})
    assert assert_openai_error(response, 400)["param"] == "max_tokens"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_max_tokens_within_the_context_stops_where_the_context_ends(service: Service, path: str) -> None:
    response = service.http.post(path, json={"messages": MESSAGES, "prompt": "hi", "max_tokens": 64})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 64, body


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "stream": True}),
        ("/v1/completions", {"prompt": LONG}),
        ("/v1/completions", {"prompt": LONG, "stream": True}),
        ("/v1/responses", {"input": LONG}),
    ],
)
def test_prompts_over_the_context_are_a_400(service: Service, path: str, body: dict[str, Any]) -> None:
    response = service.http.post(path, json=body)
    error = assert_openai_error(response, 400)
    assert error["type"] != "server_error", error


@pytest.mark.parametrize(
    "part",
    [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text"},  # no text
        {"text": "no type"},
        "a bare string in a parts list",
    ],
)
def test_unknown_or_broken_content_parts_are_a_400(service: Service, part: Any) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}], "max_tokens": 2}
    error = assert_openai_error(service.http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] is not None and error["param"].startswith("messages"), error


NOT_UTF8 = b"\xff\xfe\x00"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/responses", "/v1/models/add",
                                  "/v1/models/unload"])
@pytest.mark.parametrize("content", [b'{"model": ', NOT_UTF8, b"", b"null", b"[1, 2]"])
def test_malformed_json_is_a_400(service: Service, path: str, content: bytes) -> None:
    response = service.http.post(path, content=content, headers={"content-type": "application/json"})
    assert assert_openai_error(response, 400)["code"] == "invalid_request"
