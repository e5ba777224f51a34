"""The fake engine keeps the engine contract (`rayrunner.engines.base`, `GenerationEvent`'s rules), so the replica
and router tests that run on it mean something: one text event per token, one final event per choice with its
finish_reason and counts, interleaved choices, logprobs per token, and failures where its script puts them."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rayrunner.engines.parked_weights import ParkedWeights
from rayrunner.errors import InvalidRequestError, ModelLoadError, ServerOverloadedError, UnsupportedRequestError
from rayrunner.models.spec import build_spec
from rayrunner.openai.events import GenerationEvent
from rayrunner.openai.sampling_params import sampling_params
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from tests.fake_engine import LOGPROB, FakeEngine, FakeEngines, Script

TEXT = build_spec("fake", {"type": "plain", "model_id": "/models/fake"})
EMBEDDING = build_spec("fake-embed", {"type": "embedding", "model_id": "/models/fake-embed"})


def chat(engine: FakeEngine, **body: Any) -> AsyncIterator[GenerationEvent]:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "one two three"}],
                                                     **body})
    return engine.chat(request, sampling_params(request, engine.spec.engine))


async def collect(events: AsyncIterator[GenerationEvent]) -> list[GenerationEvent]:
    return [event async for event in events]


def check_contract(events: list[GenerationEvent], n: int) -> dict[int, str]:
    """Every choice's text, after checking GenerationEvent's rules: text events, then exactly one final event with
    its finish_reason and counts (a token per text event here), and nothing of that choice after it."""
    texts: dict[int, list[str]] = {}
    finals: dict[int, GenerationEvent] = {}
    for event in events:
        assert event.index not in finals, f"choice {event.index} has an event after its final one"
        texts.setdefault(event.index, []).append(event.text)
        if event.finish_reason is not None:
            finals[event.index] = event
    assert sorted(finals) == list(range(n))
    for index, final in finals.items():
        assert final.finish_reason in ("stop", "length")
        assert final.prompt_tokens > 0 and final.completion_tokens == sum(1 for text in texts[index] if text)
    return {index: "".join(parts) for index, parts in texts.items()}


async def test_one_event_per_token_then_one_final_event() -> None:
    engine = FakeEngine(TEXT, Script(tokens=["a", "b", "c"]))
    events = await collect(chat(engine))
    assert [e.text for e in events] == ["a", "b", "c", ""]
    assert check_contract(events, 1) == {0: "abc"}
    final = events[-1]
    assert (final.finish_reason, final.prompt_tokens, final.completion_tokens) == ("stop", 3, 3)


async def test_max_tokens_ends_with_length_and_a_stop_string_with_stop() -> None:
    engine = FakeEngine(TEXT, Script(tokens=["a", "b", "STOP", "c"]))
    cut = await collect(chat(engine, max_tokens=2))
    assert check_contract(cut, 1) == {0: "ab"} and cut[-1].finish_reason == "length"
    stopped = await collect(chat(engine, stop=["STOP"]))
    assert check_contract(stopped, 1) == {0: "ab"} and stopped[-1].finish_reason == "stop"
    assert engine.requests[0].max_tokens == 2


async def test_choices_interleave_and_each_ends_once() -> None:
    engine = FakeEngine(TEXT, Script(tokens=["x", "y"]))
    events = await collect(chat(engine, n=3))
    assert [e.index for e in events] == [0, 1, 2] * 3
    assert check_contract(events, 3) == {0: "xy", 1: "xy", 2: "xy"}


async def test_logprobs_per_token_and_the_prompts_once_per_choice() -> None:
    engine = FakeEngine(TEXT, Script(tokens=["x", "y"]))
    request = CompletionRequest.model_validate({"prompt": "p q", "logprobs": 2, "echo": True, "n": 2})
    events = await collect(engine.complete(request, sampling_params(request, TEXT.engine)))
    check_contract(events, 2)
    for event in events:
        assert event.logprobs is None if not event.text else [(e.token, e.logprob, len(e.top)) for e in
                                                              event.logprobs or []] == [(event.text, LOGPROB, 2)]
    firsts = [e for e in events if e.prompt_logprobs]
    assert [e.index for e in firsts] == [0, 1] and events.index(firsts[1]) == 1
    assert [(t.token, t.logprob) for t in firsts[0].prompt_logprobs or []] == [("p", None), ("q", LOGPROB)]


async def test_failures_where_the_script_puts_them() -> None:
    script = Script(tokens=["a", "b", "c"], fail_at=2, error=ServerOverloadedError("boom"))
    engine = FakeEngine(TEXT, script)
    seen: list[str] = []
    with pytest.raises(ServerOverloadedError):
        async for event in chat(engine):
            seen.append(event.text)
    assert seen == ["a", "b"] and engine.streaming == 0
    script.fail_at = 0
    with pytest.raises(ServerOverloadedError):
        await anext(aiter(chat(engine)))
    script.fail_at, script.refuse = None, ServerOverloadedError("queue full")
    with pytest.raises(ServerOverloadedError, match="queue full"):
        chat(engine)  # before any stream exists, as a full queue is refused
    with pytest.raises(ModelLoadError, match="no weights"):
        FakeEngine(TEXT, Script(fail_load="no weights"))
    with pytest.raises(InvalidRequestError, match="context"):
        FakeEngine(TEXT, Script(context=8)).chat(*_request(max_tokens=9))
    FakeEngine(TEXT, Script()).check_health()
    with pytest.raises(RuntimeError, match="wedged"):
        FakeEngine(TEXT, Script(unhealthy="wedged")).check_health()


def _request(**body: Any) -> tuple[ChatCompletionRequest, Any]:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    return request, sampling_params(request, TEXT.engine)


async def test_a_stream_closed_by_its_reader_stops() -> None:
    engine = FakeEngine(TEXT, Script(tokens=["a"] * 100, delay_s=0.001))
    events = chat(engine)
    await anext(aiter(events))
    assert engine.streaming == 1
    await events.aclose()  # type: ignore[attr-defined]
    assert engine.streaming == 0


async def test_embeddings_one_vector_per_text_in_order_and_kinds_refused() -> None:
    engine = FakeEngine(EMBEDDING, Script(dims=3))
    result = await engine.embed(["a b", "c", "a b"])
    assert len(result.vectors) == 3 and all(len(v) == 3 for v in result.vectors)
    assert result.vectors[0] == result.vectors[2] != result.vectors[1] and result.prompt_tokens == 5
    with pytest.raises(UnsupportedRequestError):
        chat(engine)
    with pytest.raises(UnsupportedRequestError):
        await FakeEngine(TEXT, Script()).embed(["a"])
    assert engine.info().kind == "embedding" and FakeEngine(TEXT, Script()).info().weight_bytes == (16 * 16 + 16) * 4


async def test_sleep_parks_the_weights_between_steps_and_wake_restores_them(tmp_path: Path) -> None:
    engine = FakeEngine(TEXT, Script(tokens=["a"]))
    parking = ParkedWeights("fake", tmp_path)
    where = await engine.between_steps(lambda: threading.current_thread().name)
    assert where.startswith("fake-fake")
    await engine.sleep(parking)
    assert parking.path.is_file()
    with pytest.raises(RuntimeError, match="parked"):
        await collect(chat(engine))
    await engine.wake(parking)
    assert check_contract(await collect(chat(engine)), 1) == {0: "a"}


async def test_adapters_once_loaded_and_a_closed_engine_refuses() -> None:
    engine = FakeEngine(TEXT, Script(tokens=["a"]))
    request, params = _request()
    with pytest.raises(InvalidRequestError, match="not loaded"):
        engine.chat(request, params, adapter="style")
    await engine.use_adapter("style", "/adapters/style")
    assert check_contract(await collect(engine.chat(request, params, adapter="style")), 1) == {0: "a"}
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        chat(engine)


def test_the_factory_builds_the_specs_kind_and_keeps_what_it_built() -> None:
    engines = FakeEngines(Script(tokens=["z"]))
    built = [engines(spec) for spec in (TEXT, EMBEDDING)]
    assert engines.built == built and [e.kind for e in built] == ["text", "embedding"]
