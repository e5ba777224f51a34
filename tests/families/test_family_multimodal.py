"""Which families rayrunner serves with images: a tiny vision-language model of each, loaded by `MultimodalEngine`
from a folder as a checkpoint is, answers chats with and without images, alone and all at once, as transformers'
`generate` does on the same processor inputs (float32), and an image changes the answer.

Served: LLaVA (Llama) and Gemma 3. Not served: Mistral 3 (Pixtral) and Qwen2-VL / Qwen2.5-VL, whose transformers
processors need torchvision (a video processor, Pixtral's image processor), which rayrunner does not install; and
the Qwen-VL families are refused with a 400 whatever is installed, by `arch` and by the config's `model_type`: their
M-RoPE positions are not the scheduler's (the last tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from rayrunner.engines.loading import check_positions
from rayrunner.engines.transformers.multimodal import MultimodalEngine, to_conversation
from rayrunner.errors import InvalidSpecError, ModelLoadError
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest
from tests.families import tiny_multimodal
from tests.tiny_models import image_data_url

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENS = 8
NOISE = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8))
STRIPES = Image.fromarray(np.tile(np.arange(48, dtype=np.uint8)[None, :, None] * 5, (40, 1, 3)))
SERVED: dict[str, Callable[[Path], str]] = {"Llama (LLaVA)": tiny_multimodal.llava,
                                            "Gemma 3": tiny_multimodal.gemma3}
NEEDS_TORCHVISION: dict[str, Callable[[Path], str]] = {
    "Mistral (Mistral 3 / Pixtral)": tiny_multimodal.mistral3,
    "Qwen2 (Qwen2-VL)": tiny_multimodal.qwen2_vl,
    "Qwen2 (Qwen2.5-VL)": lambda folder: tiny_multimodal.qwen2_vl(folder, "qwen2_5_vl"),
}


def _chat(text: str, *images: Image.Image) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": image_data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


CHATS = [(_chat("What is in this picture?", NOISE), [NOISE]), (_chat("What is in this picture?", STRIPES), [STRIPES]),
         (_chat("Hello there, how are you today?"), []), (_chat("Describe it in one word.", NOISE), [NOISE])]


@pytest.fixture(scope="module", params=list(SERVED))
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultimodalEngine]:
    folder = SERVED[request.param](tmp_path_factory.mktemp("vlm"))
    engine = MultimodalEngine(build_spec("vlm", {"type": "multimodal_plain", "model_id": folder, "dtype": "f32"}))
    yield engine
    engine.close()


async def _reply(engine: MultimodalEngine, messages: list[dict[str, Any]]) -> str:
    request = ChatCompletionRequest(messages=messages)
    return "".join([e.text async for e in engine.chat(request, SamplingParams(max_tokens=TOKENS))])


def _generate(engine: MultimodalEngine, messages: list[dict[str, Any]], images: list[Image.Image]) -> str:
    conversation, _ = to_conversation(ChatCompletionRequest(messages=messages).messages)
    inputs = engine._inputs(conversation, images)
    with torch.inference_mode():
        out = engine._model.generate(**inputs, max_new_tokens=TOKENS, do_sample=False)
    return str(engine._tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))


async def test_a_served_family_answers_images_alone_and_together_as_generate(engine: MultimodalEngine) -> None:
    alone = [await _reply(engine, messages) for messages, _ in CHATS]
    together = await asyncio.gather(*(_reply(engine, messages) for messages, _ in CHATS))
    expected = [_generate(engine, messages, images) for messages, images in CHATS]
    assert list(together) == alone == expected
    assert len(set(alone[:2])) == 2  # the image steers the answer
    assert engine.scheduler.max_running > 1  # its sequences share the running batch


@pytest.mark.parametrize("family", list(NEEDS_TORCHVISION))
def test_families_whose_processor_needs_torchvision_are_not_served(family: str, tmp_path: Path) -> None:
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.fail("torchvision is installed: check whether these families now load, and update the table")
    with pytest.raises((ImportError, AttributeError, ModelLoadError), match="(?i)torchvision|VIDEO_PROCESSOR"):
        NEEDS_TORCHVISION[family](tmp_path)


@pytest.mark.parametrize("arch", ["Qwen2VL", "Qwen2_5VL", "Qwen3VL", "qwen3_vl_moe"])
def test_qwen_vl_architectures_are_refused_when_added(arch: str) -> None:
    with pytest.raises(InvalidSpecError, match="is not served: its image positions are M-RoPE's") as caught:
        build_spec("vlm", {"type": "multimodal_plain", "model_id": "Qwen/Qwen2-VL-2B-Instruct", "arch": arch})
    assert caught.value.status == 400 and caught.value.param == "which.arch"
    assert "Value error" not in caught.value.message
    assert build_spec("vlm", {"type": "multimodal_plain", "model_id": "m", "arch": "LLaVA"}).which.arch


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_qwen_vl_checkpoint_without_arch_is_refused_when_it_loads(model_type: str, tmp_path: Path) -> None:
    """Refused from its config.json, before its processor (which would need torchvision) or weights are read."""
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(InvalidSpecError, match=f"model_type `{model_type}` is not served") as caught:
        MultimodalEngine(build_spec("vlm", {"type": "multimodal_plain", "model_id": str(tmp_path)}))
    assert caught.value.status == 400


def test_qwen2_vl_positions_are_not_the_schedulers_so_such_a_model_is_refused() -> None:
    """Why they are refused, on the model alone (no processor: torchvision is missing): the logits of a prompt with a
    2 x 2 image through the scheduler's positions (count of real tokens) differ from the model's own M-RoPE ones; and
    a loaded model with a rope index of its own is refused whatever its type says."""
    from transformers import AutoConfig, AutoModelForImageTextToText, Qwen2VLImageProcessorPil

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen2_vl", vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                                       spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503)
    model = AutoModelForImageTextToText.from_config(config).eval()
    processor = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 56)
    pixels = processor(images=[NOISE.resize((56, 56))], return_tensors="pt")  # 2 x 2 merged patches
    ids = torch.tensor([[5, 6, 7, 502, 500, 500, 500, 500, 503, 8, 9, 10]])
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        own = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == 500).long(), **pixels).logits
        scheduler = model(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == 500).long(),
                          position_ids=(mask.cumsum(1) - 1), **pixels).logits
    torch.testing.assert_close(scheduler[0, :4], own[0, :4])  # the text before the image: the same positions
    assert not torch.allclose(scheduler[0, 4:], own[0, 4:])  # the image and the text after it: not
    with pytest.raises(InvalidSpecError, match="M-RoPE"):
        check_positions(model)
