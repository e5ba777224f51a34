"""The router's gate as pure logic: API keys by route, body size, per-request token limits, timeouts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from rayrunner.errors import InvalidRequestError, RequestTimeoutError
from rayrunner.registry.config import ApiKeys, RequestLimits
from rayrunner.router import timeouts
from rayrunner.router.gate import Gate


def scope(method: str, path: str, key: str | None = None, length: int | None = None) -> dict[str, Any]:
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "method": method, "path": path, "headers": headers}


async def call(gate_keys: ApiKeys, request: dict[str, Any], body: list[bytes] | None = None,
               limits: RequestLimits | None = None) -> tuple[int, dict[str, Any] | None, bytes | None]:
    """Send one request through a Gate in front of an app that echoes what it read; (status, error, body seen)."""
    Gate.keys, Gate.limits = gate_keys, limits or RequestLimits()
    seen: list[bytes] = []

    async def app(_: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    chunks = list(body or [b""])
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await Gate(app)(request, receive, send)
    error = json.loads(sent[1]["body"]) if len(sent) > 1 else None
    return sent[0]["status"], error, seen[0] if seen else None


KEYS = ApiKeys(api_keys=["user-key"], admin_api_keys=["admin-key"])


@pytest.mark.parametrize(("method", "path", "key", "status"), [
    ("POST", "/v1/chat/completions", None, 401),
    ("POST", "/v1/chat/completions", "wrong", 401),
    ("POST", "/v1/chat/completions", "user-key", 200),
    ("POST", "/v1/chat/completions", "admin-key", 200),
    ("GET", "/v1/models", None, 401),
    ("GET", "/v1/models", "user-key", 200),
    ("POST", "/v1/models/status", "user-key", 200),
    ("POST", "/v1/models/unload", None, 401),
    ("POST", "/v1/models/unload", "user-key", 403),
    ("POST", "/v1/models/add", "user-key", 403),
    ("POST", "/v1/models/unload", "admin-key", 200),
    ("GET", "/health", None, 200),
    ("GET", "/openapi.json", None, 200),
])
async def test_keys_by_route(method: str, path: str, key: str | None, status: int) -> None:
    got, error, _ = await call(KEYS, scope(method, path, key))
    assert got == status
    if status != 200:
        assert error is not None and error["error"]["code"] in ("invalid_api_key", "permission_denied")
        assert "user-key" not in json.dumps(error) and "admin-key" not in json.dumps(error)


async def test_no_keys_configured_means_open() -> None:
    assert (await call(ApiKeys(), scope("POST", "/v1/models/remove")))[0] == 200


async def test_admin_keys_alone_leave_inference_open_and_guard_admin() -> None:
    keys = ApiKeys(admin_api_keys=["admin-key"])
    assert (await call(keys, scope("POST", "/v1/chat/completions")))[0] == 200
    assert (await call(keys, scope("POST", "/v1/models/remove")))[0] == 401


@pytest.mark.parametrize("path", ["/v1/models/add", "/v1/models/remove", "/v1/models/unload", "/v1/models/scale"])
async def test_inference_keys_alone_turn_the_admin_api_off(path: str) -> None:
    keys = ApiKeys(api_keys=["user-key"])
    status, error, _ = await call(keys, scope("POST", path, "user-key"))
    assert status == 403 and error is not None and error["error"]["code"] == "permission_denied"
    assert "no admin API keys" in error["error"]["message"] and "admin API is off" in error["error"]["message"]
    status, error, _ = await call(keys, scope("POST", path))
    assert status == 401 and error is not None and "valid API key" in error["error"]["message"]
    assert (await call(keys, scope("POST", "/v1/models/status", "user-key")))[0] == 200  # a read stays on
    assert (await call(keys, scope("POST", "/v1/chat/completions", "user-key")))[0] == 200


async def test_an_admin_key_from_the_environment_turns_the_admin_api_back_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYRUNNER_ADMIN_API_KEYS", "env-admin")
    Gate.configure(ApiKeys(api_keys=["user-key"]), RequestLimits())
    keys = Gate.keys
    assert (await call(keys, scope("POST", "/v1/models/unload", "env-admin")))[0] == 200
    status, error, _ = await call(keys, scope("POST", "/v1/models/unload", "user-key"))
    assert status == 403 and error is not None and "needs an admin key" in error["error"]["message"]


async def test_keys_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYRUNNER_API_KEYS", " a , b ,")
    monkeypatch.setenv("RAYRUNNER_ADMIN_API_KEYS", "c")
    keys = ApiKeys(api_keys=["x"]).with_environment()
    assert keys.api_keys == ["x", "a", "b"] and keys.admin_api_keys == ["c"]


async def test_body_over_the_limit_by_declared_length_is_413() -> None:
    limits = RequestLimits(max_body_bytes=1024)
    status, error, seen = await call(ApiKeys(), scope("POST", "/v1/chat/completions", length=5000), [b"x"], limits)
    assert status == 413 and error is not None and error["error"]["code"] == "request_too_large" and seen is None


async def test_chunked_body_over_the_limit_is_413_and_one_within_reaches_the_route_whole() -> None:
    limits = RequestLimits(max_body_bytes=1024)
    status, _, _ = await call(ApiKeys(), scope("POST", "/v1/completions"), [b"x" * 600, b"y" * 600], limits)
    assert status == 413
    status, _, seen = await call(ApiKeys(), scope("POST", "/v1/completions"), [b"x" * 500, b"y" * 500], limits)
    assert status == 200 and seen == b"x" * 500 + b"y" * 500


def test_max_tokens_limit() -> None:
    limits = RequestLimits(max_tokens=64)
    assert limits.bounded({"max_tokens": None})["max_tokens"] == 64
    assert limits.bounded({"max_tokens": 10})["max_tokens"] == 10
    with pytest.raises(InvalidRequestError, match="64") as caught:
        limits.bounded({"max_tokens": 65})
    assert caught.value.param == "max_tokens"
    assert RequestLimits().bounded({"max_tokens": 10**9}) == {"max_tokens": 10**9}


async def test_timeout_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(RequestTimeoutError):
        async with timeouts.within(0.05):
            await slow()
    assert cancelled.is_set()


async def test_stream_past_its_deadline_ends_with_a_timeout_and_closes_the_source() -> None:
    closed = asyncio.Event()

    async def ticks() -> AsyncIterator[int]:
        try:
            for i in range(100):
                yield i
                await asyncio.sleep(0.02)
        finally:
            closed.set()

    got = []
    with pytest.raises(RequestTimeoutError):
        async for item in timeouts.until(timeouts.deadline(0.1), ticks()):
            got.append(item)
    assert 1 <= len(got) < 100 and closed.is_set()
