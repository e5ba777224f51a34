"""Sleep and wake in a replica (the ModelServer class, in-process): sleep parks the weights once in-flight requests
are done, the next request wakes the same engine and answers as before, and lost parked weights mean a rebuilt
engine. On the fake engine (its weights a tiny module parked by the real `ParkedWeights`), but for one test on
SmolLM2 that the weights' memory really goes back to the OS."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import psutil
import pytest

from rayrunner.errors import ModelLoadError, ModelTimeoutError
from rayrunner.models.spec import build_spec
from rayrunner.replica.model_server import ModelServer
from tests.fake_engine import FakeEngines, Script

ASK = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}


@pytest.fixture(autouse=True)
def parked_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The fake's parked weights in the test's own folder (the real model keeps the cache: its converted weights
    are there)."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path))


def fake_server(script: Script | None = None, **engine: Any) -> tuple[ModelServer, FakeEngines]:
    engines = FakeEngines(script or Script(tokens=["Paris", "."]))
    spec = build_spec("napper", {"type": "plain", "model_id": "/models/napper"}, engine=engine or None)
    return ModelServer(spec.model_dump(mode="json"), engine_factory=engines), engines


async def answer(server: ModelServer) -> str:
    return str((await server.chat(ASK))["choices"][0]["message"]["content"])


async def test_sleep_parks_the_weights_and_a_request_wakes_the_same_engine() -> None:
    server, engines = fake_server()
    before = await answer(server)
    weights = server.info()["weight_bytes"]
    info = await server.sleep()
    assert info["asleep"] and "weight_bytes" not in info and info["slept_at"] is not None
    assert server.slot._weights.path.is_file() and engines.built[0].loaded.model.weight is None
    assert (await server.sleep())["asleep"]  # a second sleep changes nothing
    assert await answer(server) == before  # wakes it
    info = server.info()
    assert not info["asleep"] and info["weight_bytes"] == weights and info["last_wake_s"] > 0
    assert len(engines.built) == 1 and server.slot.engine is engines.built[0]


async def test_wake_puts_the_weights_back_and_is_a_no_op_when_awake() -> None:
    server, engines = fake_server()
    await server.sleep()
    assert not (await server.wake())["asleep"]
    assert engines.built[0].loaded.model.weight is not None
    assert not (await server.wake())["asleep"] and len(engines.built) == 1


async def test_sleep_waits_for_a_stream_in_flight() -> None:
    server, _ = fake_server(Script(tokens=["x"] * 20, delay_s=0.01))
    chunks: list[dict[str, Any]] = []
    answering = asyncio.Event()

    async def stream() -> None:
        async for batch in server.chat_stream({**ASK, "max_tokens": 40, "stream": True}):
            chunks.extend(batch)
            answering.set()

    streaming = asyncio.ensure_future(stream())
    await asyncio.wait_for(answering.wait(), 10)  # in flight: its first chunks are out
    await server.sleep()
    assert streaming.done() and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert server.info()["asleep"]


async def test_a_request_during_sleep_waits_for_it_then_wakes_the_engine() -> None:
    server, _ = fake_server(Script(tokens=["x"] * 10, delay_s=0.01))
    first = asyncio.ensure_future(server.chat(ASK))
    while not server.sequences:
        await asyncio.sleep(0.001)
    sleeping = asyncio.ensure_future(server.sleep())
    await asyncio.sleep(0.02)
    late = asyncio.ensure_future(server.chat(ASK))  # queued behind the sleep
    await asyncio.gather(first, sleeping)
    assert (await late)["usage"]["completion_tokens"] == 10 and not server.info()["asleep"]
    assert server.slot.last_wake_s is not None


async def test_sleep_gives_up_when_a_request_outlasts_the_drain_timeout() -> None:
    server, _ = fake_server(Script(tokens=["x"] * 50, delay_s=0.01), graceful_shutdown_timeout_s=0.05)
    busy = asyncio.ensure_future(server.chat(ASK | {"max_tokens": 50}))
    while not server.sequences:
        await asyncio.sleep(0.001)
    with pytest.raises(ModelTimeoutError, match="not put to sleep"):
        await server.sleep()
    assert not server.info()["asleep"]
    assert (await busy)["usage"]["completion_tokens"] == 50  # the request it waited for is untouched


async def test_a_wake_whose_parked_weights_are_lost_builds_the_engine_again() -> None:
    server, engines = fake_server()
    before = await answer(server)
    await server.sleep()
    server.slot._weights.path.unlink()  # e.g. someone cleaned the cache folder
    assert await answer(server) == before
    assert len(engines.built) == 2 and server.slot.engine is engines.built[1]
    assert engines.built[0].closed and not server.info()["asleep"]


async def test_a_failed_rebuild_leaves_the_model_asleep_and_the_next_request_tries_again() -> None:
    server, engines = fake_server()
    await server.sleep()
    server.slot._weights.path.unlink()
    engines.script.fail_load = "the source is gone"
    with pytest.raises(ModelLoadError, match="source is gone"):
        await server.chat(ASK)
    assert server.info()["asleep"] and server.sequences == 0
    engines.script.fail_load = None
    assert await answer(server) == "Paris." and len(engines.built) == 2


def test_closing_the_replica_removes_its_parked_weights() -> None:
    server, engines = fake_server()
    asyncio.run(server.sleep())
    path = server.slot._weights.path
    assert path.is_file()
    server.slot.close()
    assert not path.exists() and engines.built[0].closed


def _rss() -> int:
    gc.collect()
    return int(psutil.Process().memory_info().rss)


@pytest.mark.slow
async def test_a_real_models_weights_go_back_to_the_os_and_come_back_as_normal_tensors() -> None:
    """SmolLM2: what the fake cannot show. The memory is freed, and a wake puts the weights back into the same
    engine as normal tensors, though restored on the step loop's thread (in inference mode): inference-tensor
    weights made every lm_head call copy its weight (a 1-token chat took 1.7x as long after a wake). Parked weights
    that are lost mean the model loaded again, answering the same."""
    spec = build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct"})
    server = ModelServer(spec.model_dump(mode="json"))
    try:
        before = await answer(server)
        engine, weights, awake_rss = server.slot.engine, server.info()["weight_bytes"], _rss()
        await server.sleep()
        assert awake_rss - _rss() > 0.8 * weights  # the weights' memory went back to the OS
        assert all(p is None for m in engine.loaded.model.modules() for p in m._parameters.values())
        assert await answer(server) == before  # wakes it
        assert server.slot.engine is engine and server.info()["weight_bytes"] == weights
        assert not any(p.is_inference() for p in engine.loaded.model.parameters())
        await server.sleep()
        server.slot._weights.path.unlink()  # e.g. someone cleaned the cache folder
        assert await answer(server) == before and server.slot.engine is not engine
    finally:
        server.slot.close()
