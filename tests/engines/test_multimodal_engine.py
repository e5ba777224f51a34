"""MultimodalEngine on a tiny random LLaVA, in process (no Ray): images steer the output, events follow the rules."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from safetensors.torch import load_file

from rayrunner.engines.detokenizer import StopFilter
from rayrunner.engines.transformers.multimodal import MultimodalEngine, to_conversation
from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import build_spec
from rayrunner.openai.events import GenerationEvent
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest, ChatMessage
from tests.tiny_models import build_tiny_llava, image_data_url

RED = image_data_url(Image.new("RGB", (48, 40), (255, 0, 0)))
NOISE = image_data_url(Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)))
IMAGE_TOKENS = 16  # (32 / 8) ** 2 patches; the CLS feature is dropped


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"))


def _engine(model_dir: str, **engine: Any) -> MultimodalEngine:
    return MultimodalEngine(build_spec("llava", {"type": "multimodal_plain", "model_id": model_dir}, engine=engine))


@pytest.fixture(scope="module")
def engine(model_dir: str) -> MultimodalEngine:
    return _engine(model_dir)


def _ask(text: str, *image_urls: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


async def _run(engine: MultimodalEngine, messages: list[dict[str, Any]], **params: Any) -> list[GenerationEvent]:
    request = ChatCompletionRequest(messages=messages)
    return [event async for event in engine.chat(request, SamplingParams(**{"max_tokens": 8, **params}))]


def _text(events: list[GenerationEvent]) -> str:
    return "".join(event.text for event in events)


async def test_different_images_give_different_answers(engine: MultimodalEngine) -> None:
    red = _text(await _run(engine, _ask("What is in this picture?", RED)))
    noise = _text(await _run(engine, _ask("What is in this picture?", NOISE)))
    assert red and noise and red != noise
    assert _text(await _run(engine, _ask("What is in this picture?", RED))) == red  # greedy is deterministic


async def test_events_follow_the_generation_rules(engine: MultimodalEngine) -> None:
    events = await _run(engine, _ask("Describe it.", NOISE), max_tokens=6)
    *steps, final = events
    assert len(steps) >= 2, "text should stream in several events"
    assert all(e.text and e.finish_reason is None for e in steps)
    assert final.finish_reason == "length" and final.completion_tokens == 6
    text_only = await _run(engine, _ask("Describe it."), max_tokens=6)
    assert final.prompt_tokens == text_only[-1].prompt_tokens + IMAGE_TOKENS
    assert final.prompt_time_s > 0 and final.completion_time_s > 0


async def test_text_only_chat(engine: MultimodalEngine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    events = await _run(engine, messages, max_tokens=5)
    assert _text(events) and events[-1].finish_reason == "length" and events[-1].completion_tokens == 5


async def test_several_images_in_several_messages(engine: MultimodalEngine) -> None:
    messages = [*_ask("first", RED), {"role": "assistant", "content": "ok"}, *_ask("second", NOISE)]
    events = await _run(engine, messages, max_tokens=2)
    one = await _run(engine, [*_ask("first"), {"role": "assistant", "content": "ok"}, *_ask("second", NOISE)])
    assert events[-1].prompt_tokens == one[-1].prompt_tokens + IMAGE_TOKENS


async def test_remote_image_url_is_refused(engine: MultimodalEngine) -> None:
    with pytest.raises(InvalidRequestError, match="remote image URLs are disabled"):
        await _run(engine, _ask("What is this?", "http://example.com/cat.png"))


async def test_image_token_in_user_text_is_plain_text(engine: MultimodalEngine) -> None:
    events = await _run(engine, _ask("Is <image> a token?"), max_tokens=2)
    assert events[-1].finish_reason == "length"


async def test_stop_string_cuts_the_text(engine: MultimodalEngine) -> None:
    full = _text(await _run(engine, _ask("Tell me a story."), max_tokens=12))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    events = await _run(engine, _ask("Tell me a story."), max_tokens=12, stop=["never-seen", stop])
    assert _text(events) == full[: full.index(stop)]
    assert events[-1].finish_reason == "stop" and events[-1].completion_tokens < 12


async def test_seeded_sampling_is_reproducible(engine: MultimodalEngine) -> None:
    sample = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_tokens": 10}
    first = _text(await _run(engine, _ask("Hi", RED), seed=7, **sample))
    assert _text(await _run(engine, _ask("Hi", RED), seed=7, **sample)) == first
    others = {_text(await _run(engine, _ask("Hi", RED), seed=seed, **sample)) for seed in (1, 2, 3)}
    assert others - {first}


async def test_max_seq_len_caps_and_refuses(model_dir: str, engine: MultimodalEngine) -> None:
    prompt_tokens = (await _run(engine, _ask("Hi", RED), max_tokens=1))[-1].prompt_tokens
    capped = _engine(model_dir, max_seq_len=prompt_tokens + 3)
    events = await _run(capped, _ask("Hi", RED), max_tokens=4)
    assert events[-1].completion_tokens == 3 and events[-1].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="context is"):
        await _run(_engine(model_dir, max_seq_len=prompt_tokens), _ask("Hi", RED))


async def test_closing_the_stream_stops_generation(engine: MultimodalEngine) -> None:
    request = ChatCompletionRequest(messages=_ask("Go on forever."))
    stream = engine.chat(request, SamplingParams(max_tokens=2000))
    await anext(stream)
    await stream.aclose()  # what a client disconnect does
    started = time.perf_counter()
    events = await asyncio.wait_for(_run(engine, _ask("Next")), timeout=30)
    assert events[-1].finish_reason == "length"
    assert time.perf_counter() - started < 2.0, "the abandoned generation should have stopped"


def test_info(engine: MultimodalEngine) -> None:
    info = engine.info()
    assert (info.kind, info.device, info.dtype) == ("multimodal", "cpu", "bfloat16")
    assert info.weight_bytes > 0 and info.extra["model_type"] == "llava"


def test_to_conversation() -> None:
    messages = [
        ChatMessage(role="developer", content="rules"),
        ChatMessage.model_validate({"role": "user", "content": _ask("a", RED, NOISE)[0]["content"]}),
    ]
    conversation, urls = to_conversation(messages)
    assert conversation == [
        {"role": "system", "content": [{"type": "text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "a"}]},
    ]
    assert urls == [RED, NOISE]


def test_stop_filter_holds_back_partial_matches() -> None:
    stop = StopFilter(["END"])
    assert [stop.push(t) for t in ("abc E", "N", "x E", "ND tail")] == ["abc ", "", "ENx ", ""]
    assert stop.stopped and stop.flush() == ""
    open_tail = StopFilter(["END"])
    assert open_tail.push("xyz EN") == "xyz " and open_tail.flush() == "EN" and not open_tail.stopped


def test_tiny_llava_projector_weights_are_random(model_dir: str) -> None:
    # Some families (Gemma3) zero-initialise the projector; then images would have no effect at all.
    weights = load_file(str(Path(model_dir, "model.safetensors")))
    projector = [t for name, t in weights.items() if "multi_modal_projector" in name and name.endswith("weight")]
    assert len(projector) == 2 and all(t.float().std() > 0.01 for t in projector)


async def test_concurrent_image_chats_share_the_batch_and_answer_as_alone(model_dir: str) -> None:
    """Several image chats at once (each prefilled with its images, then decoded together in one batch) answer
    exactly as each does alone (float32, so the batch's rounding cannot tip a near-tie)."""
    engine32 = MultimodalEngine(build_spec("llava32", {"type": "multimodal_plain", "model_id": model_dir,
                                                        "dtype": "f32"}))
    try:
        questions = [_ask("What is in this picture?", RED), _ask("Describe it.", NOISE),
                     [{"role": "user", "content": "No image here."}], _ask("Compare.", RED, NOISE)]
        alone = [_text(await _run(engine32, q, max_tokens=12)) for q in questions]
        steps = engine32.scheduler.stats()["steps"]
        together = await asyncio.gather(*(_run(engine32, q, max_tokens=12) for q in questions))
        assert [_text(events) for events in together] == alone
        assert engine32.scheduler.stats()["steps"] - steps <= 12 + len(questions)  # shared steps, not in turn
    finally:
        engine32.close()
