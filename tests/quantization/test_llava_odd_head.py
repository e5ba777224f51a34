"""Q4K on a tiny LLaVA whose untied lm_head has 49,153 outputs: the load succeeds, the head falls back to int8 and
is reported, and the model still answers about an image (CPU, in process)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from rayrunner.engines.transformers.multimodal import MultimodalEngine
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest
from tests.tiny_models import ODD_HEAD_SIZE, build_tiny_llava_odd_head, image_data_url

RED = image_data_url(Image.new("RGB", (48, 40), (255, 0, 0)))
NOISE = image_data_url(Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)))


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> MultimodalEngine:
    folder = build_tiny_llava_odd_head(tmp_path_factory.mktemp("tiny-llava-odd-head"))
    return MultimodalEngine(build_spec("llava", {"type": "multimodal_plain", "model_id": folder}, in_situ_quant="Q4K"))


async def answer(engine: MultimodalEngine, image_url: str) -> str:
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is this?"}]
    request = ChatCompletionRequest(messages=[{"role": "user", "content": content}])
    return "".join([event.text async for event in engine.chat(request, SamplingParams(max_tokens=6))])


def test_q4k_reports_the_odd_head_as_an_int8_fallback(engine: MultimodalEngine) -> None:
    report = engine.info().quantization
    assert report is not None and report["requested"] == "Q4K"
    head = report["fallback_layers"]["lm_head"]
    assert head["applied"] == "rayrunner int8 weight-only per-channel (CPU)"
    assert str(ODD_HEAD_SIZE) in head["reason"]
    assert list(report["fallback_layers"]) == ["lm_head"] and report["skipped_layers"] == {}


async def test_q4k_model_answers_about_an_image(engine: MultimodalEngine) -> None:
    red, noise = await answer(engine, RED), await answer(engine, NOISE)
    assert red and noise and red != noise
