"""What a model replica does, on the fake engine (in process, no Serve): replies and streams shaped as the OpenAI SDK
reads them, errors as the router maps them, its count of sequences released however a request ends, a failed load
and health."""

from __future__ import annotations

import asyncio
import base64
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from rayrunner.errors import (
    InvalidRequestError,
    ModelLoadError,
    ServerOverloadedError,
    UnsupportedRequestError,
    client_error,
)
from rayrunner.models.spec import build_spec
from rayrunner.replica.model_server import ModelServer
from tests.fake_engine import FakeEngine, FakeEngines, Script

ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}]}
TOKENS = ["Paris", " is", " the", " capital", "."]


@pytest.fixture(autouse=True)
def parked_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parked weights in the test's own folder."""
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path))


def make_server(script: Script | None = None, which: str = "plain", **engine: Any) -> ModelServer:
    spec = build_spec("fake", {"type": which, "model_id": "/models/fake"}, engine=engine or None)
    return ModelServer(spec.model_dump(mode="json"), engine_factory=FakeEngines(script or Script(tokens=TOKENS)))


@pytest.fixture
def server() -> Iterator[ModelServer]:
    server = make_server()
    yield server
    server.slot.close()


def engine_of(server: ModelServer) -> FakeEngine:
    engine = server.slot.engine
    assert isinstance(engine, FakeEngine)
    return engine


async def chunks(batches: AsyncIterator[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [chunk async for batch in batches for chunk in batch]


async def test_a_chat_reply_is_an_openai_chat_completion(server: ModelServer) -> None:
    reply = ChatCompletion.model_validate(await server.chat({**ASK, "n": 2}))
    assert reply.object == "chat.completion" and reply.model == "fake" and len(reply.choices) == 2
    assert all(c.message.content == "Paris is the capital." and c.finish_reason == "stop" for c in reply.choices)
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (6, 10)
    assert reply.usage.total_tokens == 16
    cut = ChatCompletion.model_validate(await server.chat({**ASK, "max_tokens": 2}))
    assert cut.choices[0].message.content == "Paris is" and cut.choices[0].finish_reason == "length"


async def test_a_chat_stream_is_openai_chunks_that_join_to_the_reply(server: ModelServer) -> None:
    stream = [ChatCompletionChunk.model_validate(c) for c in await chunks(server.chat_stream({**ASK, "stream": True}))]
    assert stream[0].choices[0].delta.role == "assistant" and len({c.id for c in stream}) == 1
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "Paris is the capital."
    assert stream[-1].choices[0].finish_reason == "stop" and stream[-1].usage is not None
    assert stream[-1].usage.completion_tokens == 5
    apart = await chunks(server.chat_stream({**ASK, "stream": True, "stream_options": {"include_usage": True}}))
    assert apart[-1]["choices"] == [] and apart[-1]["usage"]["completion_tokens"] == 5
    assert "usage" not in apart[-2]


async def test_completions_unary_and_streamed_with_echo(server: ModelServer) -> None:
    body = {"prompt": "Say it:", "max_tokens": 3, "echo": True}
    reply = Completion.model_validate(await server.complete(body))
    assert reply.choices[0].text == "Say it:Paris is the" and reply.choices[0].finish_reason == "length"
    stream = await chunks(server.complete_stream({**body, "stream": True}))
    assert "".join(c["choices"][0]["text"] for c in stream) == reply.choices[0].text
    assert all(c["object"] == "text_completion" and c["id"] == stream[0]["id"] for c in stream)
    last = Completion.model_validate(stream[-1])  # the SDK's type wants a finish_reason, which only the last has
    assert last.choices[0].finish_reason == "length" and last.usage is not None and last.usage.completion_tokens == 3


async def test_embeddings_as_floats_and_base64() -> None:
    server = make_server(Script(dims=3), which="embedding")
    floats = CreateEmbeddingResponse.model_validate(await server.embed({"input": ["a b", "c"]}))
    assert [d.index for d in floats.data] == [0, 1] and floats.usage.prompt_tokens == 3
    packed = await server.embed({"input": "a b", "encoding_format": "base64"})
    vector = struct.unpack("<3f", base64.b64decode(packed["data"][0]["embedding"]))
    assert vector == pytest.approx(floats.data[0].embedding)
    with pytest.raises(UnsupportedRequestError, match="embedding model"):
        await server.chat(ASK)


async def test_errors_reach_the_router_as_openai_errors(server: ModelServer) -> None:
    with pytest.raises(UnsupportedRequestError) as refused:
        await server.embed({"input": "x"})
    assert client_error(refused.value).status == 400
    with pytest.raises(InvalidRequestError) as too_long:
        await server.chat({**ASK, "max_tokens": 4096})  # past the fake's 2048-token context
    assert (client_error(too_long.value).status, too_long.value.param) == (400, "max_tokens")
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        await server.chat({**ASK, "max_tokens": 2, "min_tokens": 3})
    with pytest.raises(InvalidRequestError, match="adapter"):
        await server.chat({**ASK, "adapter": 7})
    engine_of(server).script.refuse = ServerOverloadedError("queue full", retry_after_s=2.0)
    with pytest.raises(ServerOverloadedError) as overloaded:
        await chunks(server.chat_stream({**ASK, "stream": True}))
    assert (client_error(overloaded.value).status, client_error(overloaded.value).retry_after_s) == (429, 2.0)
    assert server.sequences == 0 and server.serving == {}


async def test_a_failure_mid_stream_comes_after_the_chunks_before_it(server: ModelServer) -> None:
    engine_of(server).script.fail_at = 2
    seen: list[dict[str, Any]] = []
    with pytest.raises(RuntimeError, match="scripted failure") as failed:
        async for batch in server.chat_stream({**ASK, "stream": True}):
            seen.extend(batch)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in seen) == "Paris is"
    assert client_error(failed.value).status == 500 and "scripted" not in client_error(failed.value).message
    assert server.sequences == 0 and engine_of(server).streaming == 0


async def test_a_lora_request_loads_its_adapter_and_answers_as_it() -> None:
    server = make_server()
    reply = await server.chat({**ASK, "adapter": "pirate", "adapter_source": "/adapters/pirate"})
    assert reply["model"] == "pirate" and engine_of(server).adapters == {"pirate"}
    with pytest.raises(InvalidRequestError, match="not loaded"):
        await server.chat({**ASK, "adapter": "other"})


async def test_sequences_count_while_streaming_and_are_released_when_the_reader_leaves() -> None:
    server = make_server(Script(tokens=["x"] * 200, delay_s=0.005))
    stream = server.chat_stream({**ASK, "stream": True, "n": 3})
    await anext(aiter(stream))
    assert server.sequences == 3 and list(server.record_routing_stats()["requests"].values()) == [3]
    assert server.info()["sequences"] == 3 and engine_of(server).streaming == 1
    await stream.aclose()  # type: ignore[attr-defined]  # the router went away (client disconnect)
    assert server.sequences == 0 and server.record_routing_stats() == {"requests": {}}
    await asyncio.sleep(0.05)
    assert engine_of(server).streaming == 0  # the engine stopped generating for it
    assert server.requests_served == 1


async def test_a_cancelled_request_releases_its_sequences() -> None:
    server = make_server(Script(tokens=["x"] * 200, delay_s=0.005))
    unary = asyncio.ensure_future(server.chat({**ASK, "n": 2}))
    while not server.sequences:
        await asyncio.sleep(0.001)
    assert server.sequences == 2
    unary.cancel()  # as Serve cancels a request whose caller is gone
    with pytest.raises(asyncio.CancelledError):
        await unary
    assert server.sequences == 0 and server.serving == {}
    await asyncio.sleep(0.05)
    assert engine_of(server).streaming == 0


async def test_concurrent_requests_each_count_until_they_end() -> None:
    server = make_server(Script(tokens=["x"] * 5, delay_s=0.01))
    replies = asyncio.gather(*(server.chat({**ASK, "n": n}) for n in (1, 2, 3)))
    while server.sequences < 6:
        await asyncio.sleep(0.001)
    assert len(server.serving) == 3
    assert [len(r["choices"]) for r in await replies] == [1, 2, 3]
    assert server.sequences == 0 and server.requests_served == 3


def test_a_failed_load_fails_the_replica_constructor() -> None:
    with pytest.raises(ModelLoadError, match="weights missing"):
        make_server(Script(fail_load="weights missing"))


async def test_health_follows_the_engine_asleep_or_awake(server: ModelServer) -> None:
    server.check_health()
    await server.sleep()
    server.check_health()
    engine_of(server).script.unhealthy = "the step loop has stopped"
    with pytest.raises(RuntimeError, match="step loop"):
        server.check_health()


async def test_info_says_what_the_replica_holds(server: ModelServer) -> None:
    await server.chat(ASK)
    info = server.info()
    assert (info["kind"], info["device"], info["asleep"], info["requests_served"]) == ("text", "cpu", False, 1)
    assert info["weight_bytes"] > 0 and info["extra"]["fake"] and info["pid"] > 0
