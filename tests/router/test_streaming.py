"""The router's calls and streams, in process: `RouterService` and the `Router`'s stream shaping drive model
replicas that are `ModelServer`s on the fake engine, behind a stand-in for Serve's handle. What runs is the router's
own logic: the first chunk awaited before a stream is returned (so an error before any output keeps its status),
later errors in-band, the replica's request cancelled when the client leaves, a replica that died before the first
chunk replaced, usage counted until the stream ends. The same paths over a real cluster: tests/integration."""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from rayrunner.errors import (
    InvalidRequestError,
    ModelUnavailableError,
    RayRunnerError,
    RequestTimeoutError,
    ServerOverloadedError,
)
from rayrunner.models.spec import build_spec
from rayrunner.registry.config import RegistryConfig
from rayrunner.replica.model_server import ModelServer
from rayrunner.router import service as service_module
from rayrunner.router import usage
from rayrunner.router.app import Router, sse
from rayrunner.router.service import _GENERATES, RouterService
from tests.fake_engine import FakeEngine, FakeEngines, Script

APP = "fake-app"
ASK = {"model": "fake", "messages": [{"role": "user", "content": "hello there"}], "stream": True}
_END = object()


class ReplicaStream:
    """A stream's answer as Serve's handle gives it: the replica's generator runs in a task of its own (as on the
    replica), `cancel` cancels that task, and a replica that died answers ActorDiedError."""

    def __init__(self, items: AsyncIterator[Any]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._pump(items))

    async def _pump(self, items: AsyncIterator[Any]) -> None:
        try:
            async for item in items:
                self._queue.put_nowait(item)
        except Exception as exc:
            self._queue.put_nowait(exc)
        else:
            self._queue.put_nowait(_END)

    def __aiter__(self) -> ReplicaStream:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self._task.cancel()


async def died() -> AsyncIterator[Any]:
    raise ActorDiedError()
    yield  # an async generator


class Handle:
    """The model app's DeploymentHandle, over its replicas (in order; the first `dead` calls find theirs dead)."""

    def __init__(self, replicas: list[ModelServer], dead: int = 0) -> None:
        self.replicas, self.dead, self.calls = replicas, dead, 0

    def options(self, stream: bool = False) -> Handle:
        return self

    def __getattr__(self, method: str) -> SimpleNamespace:
        return SimpleNamespace(remote=lambda body: self._call(method, body))

    def _call(self, method: str, body: dict[str, Any]) -> Any:
        replica = self.replicas[min(self.calls, len(self.replicas) - 1)]
        self.calls += 1
        dead = self.calls <= self.dead
        if method.endswith("_stream"):
            return ReplicaStream(died() if dead else getattr(replica, method)(body))
        return asyncio.ensure_future(self._unary(replica, method, body, dead))

    async def _unary(self, replica: ModelServer, method: str, body: dict[str, Any], dead: bool) -> Any:
        if dead:
            raise ActorDiedError()
        return await getattr(replica, method)(body)


class Registry:
    """The registry actor as the router calls it: one model, its route, loads and the usage reports."""

    def __init__(self, status: str = "loaded") -> None:
        self.route = {"model_id": "fake", "app_name": APP, "status": status, "kind": "text"}
        self.loads: list[str] = []
        self.in_flight: dict[str, int] | None = None
        self.resolve = SimpleNamespace(remote=self._resolve)
        self.ensure_loaded = SimpleNamespace(remote=self._ensure_loaded)
        self.status = SimpleNamespace(remote=self._status)
        self.report_usage = SimpleNamespace(remote=self._report)

    async def _resolve(self, name: str) -> dict[str, Any]:
        return dict(self.route)

    async def _ensure_loaded(self, model_id: str) -> None:
        self.loads.append(model_id)
        self.route["status"] = "loaded"

    async def _status(self, model_id: str) -> str:
        return str(self.route["status"])

    async def _report(self, router_id: str, in_flight: dict[str, int], used: dict[str, Any]) -> None:
        self.in_flight = in_flight

    async def settled(self, expected: dict[str, int] | None = None) -> dict[str, int]:
        """The in-flight counts the router reports, once they are `expected` (none open: {}) or after 2 s."""
        expected = {} if expected is None else expected
        for _ in range(200):
            if self.in_flight == expected:
                break
            await asyncio.sleep(0.01)
        return dict(self.in_flight or {})


@pytest.fixture(autouse=True)
def parked_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(usage, "REPORT_S", 0.01)


@pytest.fixture
def script() -> Script:
    return Script(tokens=["Hi", " there", "!"])


@pytest.fixture
def replica(script: Script) -> Iterator[ModelServer]:
    spec = build_spec("fake", {"type": "plain", "model_id": "/models/fake"})
    server = ModelServer(spec.model_dump(mode="json"), engine_factory=FakeEngines(script))
    yield server
    server.slot.close()


def router_service(monkeypatch: pytest.MonkeyPatch, handle: Handle, registry: Registry | None = None,
                   **config: Any) -> tuple[RouterService, Registry]:
    """A RouterService whose registry and model handles are the stand-ins: only Ray is replaced."""
    registry = registry or Registry()
    monkeypatch.setattr(service_module, "get_registry", lambda app, path: registry)
    monkeypatch.setattr(service_module, "serve", SimpleNamespace(get_deployment_handle=lambda name, app_name: handle))
    monkeypatch.setattr(service_module, "direct", lambda found: found)
    return RouterService(RegistryConfig.model_validate(config), "rayrunner"), registry


def engine_of(server: ModelServer) -> FakeEngine:
    engine = server.slot.engine
    assert isinstance(engine, FakeEngine)
    return engine


def text_of(batches: list[list[dict[str, Any]]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for batch in batches for c in batch if c["choices"])


async def test_a_stream_carries_the_replicas_chunks_and_closes_its_request_at_the_end(
        monkeypatch: pytest.MonkeyPatch, replica: ModelServer) -> None:
    service, registry = router_service(monkeypatch, Handle([replica]))
    stream = await service.stream("fake", "chat_stream", ASK, _GENERATES)
    batches = [batch async for batch in stream]
    assert text_of(batches) == "Hi there!" and batches[-1][-1]["choices"][0]["finish_reason"] == "stop"
    assert await registry.settled() == {} and replica.sequences == 0


async def test_an_error_before_the_first_chunk_is_raised_with_its_status_and_nothing_stays_open(
        monkeypatch: pytest.MonkeyPatch, replica: ModelServer, script: Script) -> None:
    service, registry = router_service(monkeypatch, Handle([replica]))
    script.refuse = ServerOverloadedError("the model's queue is full", retry_after_s=2.0)
    with pytest.raises(ServerOverloadedError) as overloaded:
        await service.stream("fake", "chat_stream", ASK, _GENERATES)
    assert (overloaded.value.status, overloaded.value.retry_after_s) == (429, 2.0)
    script.refuse = RuntimeError("node 10.1.2.3 blew up")
    with pytest.raises(RayRunnerError) as crashed:
        await service.stream("fake", "chat_stream", ASK, _GENERATES)
    assert crashed.value.status == 500 and "10.1.2.3" not in crashed.value.message
    script.refuse = None
    with pytest.raises(InvalidRequestError) as too_long:
        await service.stream("fake", "chat_stream", {**ASK, "max_tokens": 4096}, _GENERATES)
    assert (too_long.value.status, too_long.value.param) == (400, "max_tokens")
    assert await registry.settled() == {} and replica.sequences == 0


async def test_an_engine_error_before_its_first_token_keeps_its_status(monkeypatch: pytest.MonkeyPatch,
                                                                       replica: ModelServer, script: Script) -> None:
    service, _ = router_service(monkeypatch, Handle([replica]))
    script.fail_at, script.error = 0, InvalidRequestError("the prompt needs more KV cache than the budget")
    with pytest.raises(InvalidRequestError):
        await service.stream("fake", "chat_stream", ASK, _GENERATES)


async def test_an_error_mid_stream_ends_it_as_a_client_error(monkeypatch: pytest.MonkeyPatch, replica: ModelServer,
                                                             script: Script) -> None:
    service, registry = router_service(monkeypatch, Handle([replica]))
    script.fail_at, script.error = 2, RuntimeError("pid 4242 lost")
    stream = await service.stream("fake", "chat_stream", ASK, _GENERATES)
    batches: list[list[dict[str, Any]]] = []
    with pytest.raises(RayRunnerError) as failed:
        async for batch in stream:
            batches.append(batch)
    assert text_of(batches) == "Hi there" and failed.value.status == 500 and "4242" not in failed.value.message
    assert await registry.settled() == {} and replica.sequences == 0


async def test_a_client_that_leaves_cancels_the_replicas_request(monkeypatch: pytest.MonkeyPatch,
                                                                 replica: ModelServer, script: Script) -> None:
    service, registry = router_service(monkeypatch, Handle([replica]))
    script.tokens, script.delay_s = ["x"] * 500, 0.005
    stream = await service.stream("fake", "chat_stream", {**ASK, "n": 2}, _GENERATES)
    await anext(aiter(stream))
    assert replica.sequences == 2 and engine_of(replica).streaming == 1
    await stream.aclose()  # type: ignore[attr-defined]  # the client disconnected
    for _ in range(100):
        if not replica.sequences:
            break
        await asyncio.sleep(0.01)
    assert replica.sequences == 0 and engine_of(replica).streaming == 0
    assert await registry.settled() == {}


async def test_a_stream_dropped_unread_still_closes_its_request(monkeypatch: pytest.MonkeyPatch,
                                                                replica: ModelServer) -> None:
    service, registry = router_service(monkeypatch, Handle([replica]))
    stream = await service.stream("fake", "chat_stream", ASK, _GENERATES)
    assert await registry.settled({"fake": 1}) == {"fake": 1}
    del stream
    gc.collect()
    assert await registry.settled() == {}


async def test_a_replica_that_died_before_the_first_chunk_is_replaced_by_another(
        monkeypatch: pytest.MonkeyPatch, replica: ModelServer) -> None:
    handle = Handle([replica], dead=1)
    service, _ = router_service(monkeypatch, handle)
    stream = await service.stream("fake", "chat_stream", ASK, _GENERATES)
    assert text_of([batch async for batch in stream]) == "Hi there!" and handle.calls == 2
    twice_dead = Handle([replica], dead=2)
    service, registry = router_service(monkeypatch, twice_dead)
    with pytest.raises(ModelUnavailableError):  # one retry only: then the client gets a 503 to retry
        await service.stream("fake", "chat_stream", ASK, _GENERATES)
    assert twice_dead.calls == 2 and await registry.settled() == {}


async def test_unary_calls_retry_a_dead_replica_and_map_errors(monkeypatch: pytest.MonkeyPatch, replica: ModelServer,
                                                               script: Script) -> None:
    body = {**ASK, "stream": False}
    handle = Handle([replica], dead=1)
    service, registry = router_service(monkeypatch, handle)
    reply = await service.call("fake", "chat", body, _GENERATES)
    assert reply["choices"][0]["message"]["content"] == "Hi there!" and handle.calls == 2
    script.refuse = ServerOverloadedError("the model's queue is full")
    with pytest.raises(ServerOverloadedError):
        await service.call("fake", "chat", body, _GENERATES)
    assert await registry.settled() == {} and replica.sequences == 0


async def test_an_unloaded_model_is_loaded_before_its_stream(monkeypatch: pytest.MonkeyPatch,
                                                             replica: ModelServer) -> None:
    service, registry = router_service(monkeypatch, Handle([replica]), Registry(status="unloaded"))
    stream = await service.stream("fake", "chat_stream", ASK, _GENERATES)
    assert registry.loads == ["fake"] and text_of([batch async for batch in stream]) == "Hi there!"


def router(service: RouterService) -> Any:
    """The Router deployment's own class (under Serve's ingress wrapper), built without its constructor, which
    would start the registry."""
    cls = Router.func_or_class.__bases__[0]  # type: ignore[attr-defined]
    assert cls.__module__ == "rayrunner.router.app" and cls.__name__ == "Router"
    found = cls.__new__(cls)
    found.service = service
    return found


async def frames(batches: AsyncIterator[list[dict[str, Any]]]) -> list[Any]:
    """The SSE body the client reads: each `data:` payload, parsed, and the closing `[DONE]`."""
    body = "".join([frame async for frame in sse(batches).body_iterator])  # type: ignore[misc]
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    return [event if event == "[DONE]" else json.loads(event) for event in events]


async def test_the_sse_body_ends_with_done_and_reports_a_late_error_in_band(
        monkeypatch: pytest.MonkeyPatch, replica: ModelServer, script: Script) -> None:
    front = router(router_service(monkeypatch, Handle([replica]))[0])
    events = await frames(await front._open_stream("chat_stream", ASK))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Hi there!"
    script.fail_at = 1
    events = await frames(await front._open_stream("chat_stream", ASK))
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "internal_error"
    assert events[1]["choices"][0]["delta"]["content"] == "Hi"
    script.fail_at, script.refuse = None, RuntimeError("crashed")  # before any output: the route answers the status
    with pytest.raises(RayRunnerError) as before:
        await front._open_stream("chat_stream", ASK)
    assert before.value.status == 500


async def test_a_stream_past_the_request_timeout_ends_with_a_408_and_its_work_is_cancelled(
        monkeypatch: pytest.MonkeyPatch, replica: ModelServer, script: Script) -> None:
    front = router(router_service(monkeypatch, Handle([replica]), limits={"request_timeout_s": 0.3})[0])
    script.tokens, script.delay_s = ["x"] * 1000, 0.01
    events = await frames(await front._open_stream("chat_stream", ASK))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"  # it had started
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == RequestTimeoutError.code
    assert len(events) < 900  # cut well before its 1000 tokens
    for _ in range(100):
        if not replica.sequences:
            break
        await asyncio.sleep(0.01)
    assert replica.sequences == 0 and engine_of(replica).streaming == 0


async def test_handle_callers_get_the_chunks_one_by_one(monkeypatch: pytest.MonkeyPatch,
                                                        replica: ModelServer) -> None:
    front = router(router_service(monkeypatch, Handle([replica]))[0])
    chunks = [chunk async for chunk in front.chat_stream({k: v for k, v in ASK.items() if k != "stream"})]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[-1]["usage"]["completion_tokens"] == 3
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hi there!"
