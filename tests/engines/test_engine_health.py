"""Serve's health check on a model replica: a healthy engine passes, a sleeping one passes, and an engine whose
step loop died or whose step is stuck fails (so Serve replaces the replica instead of leaving requests hanging)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rayrunner.engines.transformers.step import scheduler as scheduler_module
from rayrunner.models.spec import build_spec
from rayrunner.replica.model_server import ModelServer

ASK = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def server(tiny_llama_dir: str) -> ModelServer:
    return ModelServer(build_spec("tiny", {"type": "plain", "model_id": tiny_llama_dir}).model_dump(mode="json"))


async def test_a_working_or_sleeping_engine_is_healthy(server: ModelServer) -> None:
    await server.chat(ASK)
    server.check_health()
    await server.sleep()
    server.check_health()


async def test_a_dead_step_loop_fails_the_health_check(server: ModelServer) -> None:
    engine = server.slot.engine
    assert engine is not None

    def broken() -> None:
        raise MemoryError("simulated fault outside a model call")

    engine.scheduler._drop_cancelled = broken  # type: ignore[attr-defined,method-assign]
    with pytest.raises(MemoryError):
        await asyncio.wait_for(server.chat(ASK), 5)  # the loop dies, and fails the requests it held
    with pytest.raises(RuntimeError, match="step loop has stopped"):
        server.check_health()


@pytest.mark.slow
async def test_a_stuck_step_fails_the_health_check(server: ModelServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_module, "STUCK_STEP_S", 0.5)
    engine = server.slot.engine
    assert engine is not None
    real_prefill = engine.scheduler._prefill  # type: ignore[attr-defined]

    def slow_prefill(plan: Any) -> None:
        time.sleep(2)
        real_prefill(plan)

    engine.scheduler._prefill = slow_prefill  # type: ignore[attr-defined,method-assign]
    asking = asyncio.ensure_future(server.chat(ASK))
    while engine.scheduler._step_started_at is None:  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)
    with pytest.raises(RuntimeError, match="engine is stuck"):
        server.check_health()
    await asking
    while engine.scheduler._step_started_at is not None:  # type: ignore[attr-defined]
        await asyncio.sleep(0.05)
    server.check_health()  # the step ended: healthy again
