"""What callers see of a failure: Ray's outages as a stable 503, overload as 429 with Retry-After, anything else as
a 500 without internals (the details go to the log), through the router's own FastAPI error handlers."""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from ray.core.generated.common_pb2 import ActorDiedErrorContext
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from rayrunner.errors import (
    ModelNotFoundError,
    ModelUnavailableError,
    ServerOverloadedError,
    client_error,
)
from rayrunner.protocol import ChatCompletionRequest
from rayrunner.router.app import add_error_handlers, sse

SECRETS = ("10.1.2.3", "4242", "ab" * 16, "SERVE_REPLICA", "namespace")


def actor_died() -> ActorDiedError:
    return ActorDiedError(ActorDiedErrorContext(
        class_name="ServeReplica:model-x:ModelServer", actor_id=bytes.fromhex("ab" * 16), pid=4242,
        name="SERVE_REPLICA::model-x#ModelServer#abc", ray_namespace="serve", node_ip_address="10.1.2.3",
        error_message="The actor is dead because its worker process has died."))


@pytest.mark.parametrize(
    "raised",
    [
        actor_died(),
        RayTaskError("chat_stream", "Traceback ... 10.1.2.3", ActorDiedError()),
        ActorUnavailableError("node 10.1.2.3 unreachable", bytes.fromhex("ab" * 16)),
        DeploymentUnavailableError(DeploymentID(name="ModelServer", app_name="model-x")),
        ReplicaUnavailableError("SERVE_REPLICA::model-x#4242"),
    ],
)
def test_ray_outages_become_a_stable_503(raised: Exception, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rayrunner.errors"):
        error = client_error(raised, "model-x")
    assert isinstance(error, ModelUnavailableError)
    assert (error.status, error.code, error.type) == (503, "model_unavailable", "server_error")
    assert error.message == "model `model-x` is unavailable right now; retry"
    assert not any(s in error.message for s in SECRETS)
    assert any(raised in record.args for record in caplog.records)  # the details are logged, not sent


def test_unexpected_errors_are_a_500_without_internals(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="rayrunner.errors"):
        error = client_error(RuntimeError("worker 10.1.2.3 pid 4242 failed"))
    assert (error.status, error.code) == (500, "internal_error")
    assert not any(s in error.message for s in SECRETS) and "RuntimeError" not in error.message
    assert "worker 10.1.2.3 pid 4242 failed" in caplog.text


def test_rayrunner_errors_pass_through_and_back_pressure_is_overload() -> None:
    not_found = ModelNotFoundError("x")
    assert client_error(RayTaskError("chat", "tb", not_found)) is not_found
    overloaded = client_error(BackPressureError(num_queued_requests=9, max_queued_requests=8, retry_after_s=2.0))
    assert isinstance(overloaded, ServerOverloadedError) and overloaded.retry_after_s == 2.0


def test_new_errors_survive_pickling_like_a_trip_through_ray() -> None:
    overloaded = pickle.loads(pickle.dumps(ServerOverloadedError("queue full", retry_after_s=2.5)))
    assert (overloaded.message, overloaded.retry_after_s, overloaded.status) == ("queue full", 2.5, 429)
    assert overloaded.code == "server_overloaded" and ServerOverloadedError("x").retry_after_s == 1.0
    unavailable = pickle.loads(pickle.dumps(ModelUnavailableError("m")))
    assert unavailable.message == ModelUnavailableError("m").message
    wrapped = RayTaskError("chat", "tb", ServerOverloadedError("queue full", retry_after_s=0.2))
    assert client_error(pickle.loads(pickle.dumps(wrapped))).retry_after_s == 0.2  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def client() -> TestClient:
    """A tiny app with the router's error handlers and the three ways a route can fail."""
    app = FastAPI()
    add_error_handlers(app)

    async def overloaded() -> AsyncIterator[dict[str, Any]]:
        yield {"n": 1}
        raise ServerOverloadedError("queue full", retry_after_s=0.3)

    @app.post("/unary")
    async def unary(body: ChatCompletionRequest) -> Any:
        raise ServerOverloadedError("queue full", retry_after_s=2.5)

    @app.post("/stream")
    async def stream(body: ChatCompletionRequest) -> Any:
        if body.max_tokens == 1:  # fails before the stream opens, as the router's pre-stream check does
            raise ServerOverloadedError("queue full")
        return sse(overloaded())

    @app.post("/crash")
    async def crash() -> Any:
        raise RuntimeError("node 10.1.2.3 pid 4242")

    return TestClient(app, raise_server_exceptions=False)


BODY = {"messages": [{"role": "user", "content": "hi"}]}


def test_overload_answers_429_with_retry_after_in_whole_seconds(client: TestClient) -> None:
    response = client.post("/unary", json=BODY)
    assert response.status_code == 429 and response.headers["retry-after"] == "3"
    assert response.json()["error"]["code"] == "server_overloaded"
    before_stream = client.post("/stream", json={**BODY, "max_tokens": 1})
    assert before_stream.status_code == 429 and before_stream.headers["retry-after"] == "1"


def test_errors_in_a_stream_are_reported_in_band(client: TestClient) -> None:
    response = client.post("/stream", json=BODY)
    assert response.status_code == 200 and "retry-after" not in response.headers
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[1])["error"]["code"] == "server_overloaded" and events[-1] == "[DONE]"


def test_other_failures_keep_the_openai_shape(client: TestClient) -> None:
    crash = client.post("/crash")
    assert crash.status_code == 500 and "10.1.2.3" not in crash.text
    assert crash.json()["error"]["code"] == "internal_error" and "retry-after" not in crash.headers
    bad = client.post("/unary", json={"messages": "hi"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    not_json = client.post("/unary", content=b"{nope", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["message"] == "the request body is not valid JSON"
