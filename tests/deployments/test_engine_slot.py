"""Sleep and wake in a replica (the ModelServer class, in-process): the weights' memory is freed, the next request
wakes the model and answers as before, and sleep waits for the requests in flight."""

from __future__ import annotations

import asyncio
import gc

import psutil
import pytest

from rayrunner.deployments.model_server import ModelServer
from rayrunner.spec import build_spec

ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}


@pytest.fixture(scope="module")
def server() -> ModelServer:
    spec = build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct"})
    return ModelServer(spec.model_dump(mode="json"))


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


async def test_sleep_frees_the_weights_and_a_request_wakes_the_model(server: ModelServer) -> None:
    before = (await server.chat(ASK))["choices"][0]["message"]["content"]
    weights = server.info()["weight_bytes"]
    awake_rss = _rss()
    info = await server.sleep()
    assert info["asleep"] and "weight_bytes" not in info
    assert awake_rss - _rss() > 0.8 * weights  # the weights' memory went back to the OS
    after = await server.chat(ASK)  # wakes it
    assert after["choices"][0]["message"]["content"] == before
    info = server.info()
    assert not info["asleep"] and info["weight_bytes"] == weights and info["last_wake_s"] > 0


async def test_sleep_waits_for_a_stream_in_flight(server: ModelServer) -> None:
    chunks: list[dict[str, object]] = []

    async def stream() -> None:
        async for chunk in server.chat_stream({**ASK, "max_tokens": 40, "stream": True}):
            chunks.append(chunk)

    streaming = asyncio.ensure_future(stream())
    await asyncio.sleep(0.3)
    await server.sleep()
    assert streaming.done() and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # type: ignore[index]
    assert server.info()["asleep"]
    await server.wake()
    assert not server.info()["asleep"]
