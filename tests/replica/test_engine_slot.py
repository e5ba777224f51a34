"""Sleep and wake in a replica (the ModelServer class, in-process): the weights' memory is freed, the next request
wakes the model and answers as before, and sleep waits for the requests in flight."""

from __future__ import annotations

import asyncio
import gc

import psutil
import pytest

from rayrunner.models.spec import build_spec
from rayrunner.replica.model_server import ModelServer

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
    answering = asyncio.Event()

    async def stream() -> None:
        async for batch in server.chat_stream({**ASK, "max_tokens": 40, "stream": True}):
            chunks.extend(batch)
            answering.set()

    streaming = asyncio.ensure_future(stream())
    await asyncio.wait_for(answering.wait(), 120)  # in flight: its first chunks are out
    await server.sleep()
    assert streaming.done() and chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")  # type: ignore[index]
    assert server.info()["asleep"]
    await server.wake()
    assert not server.info()["asleep"]


async def test_a_wake_puts_the_weights_back_into_the_same_engine(server: ModelServer) -> None:
    engine = server.slot.engine
    await server.sleep()
    assert all(p is None for m in engine.loaded.model.modules() for p in m._parameters.values())
    assert server.slot._weights.path.is_file()
    await server.wake()
    assert server.slot.engine is engine  # tokenizer, compute thread and model kept: only the tensors came back
    # normal tensors, though restored on the step loop's thread (in inference mode): inference-tensor weights made
    # every lm_head call copy its weight (a 1-token chat took 1.7x as long after a wake)
    assert not any(p.is_inference() for p in engine.loaded.model.parameters())
    assert (await server.chat(ASK))["usage"]["completion_tokens"] > 0


async def test_a_wake_whose_parked_weights_are_lost_loads_the_model_again(server: ModelServer) -> None:
    before = (await server.chat(ASK))["choices"][0]["message"]["content"]
    engine = server.slot.engine
    await server.sleep()
    server.slot._weights.path.unlink()  # e.g. someone cleaned the cache folder
    after = await server.chat(ASK)
    assert after["choices"][0]["message"]["content"] == before
    assert server.slot.engine is not engine and not server.info()["asleep"]


def test_closing_the_replica_removes_its_parked_weights(tiny_llama_dir: str) -> None:
    spec = build_spec("tiny-closing", {"type": "plain", "model_id": tiny_llama_dir})
    server = ModelServer(spec.model_dump(mode="json"))
    asyncio.run(server.sleep())
    path = server.slot._weights.path
    assert path.is_file()
    server.slot.close()
    assert not path.exists()
