"""Tiny random-weight vision-language models of the families that have one, saved to a folder with a processor
(PIL-only image processing, the SmolLM2 tokenizer with the family's image tokens added, a ChatML template), so
`MultimodalEngine` loads them as it loads a checkpoint.

Each is the family's transformers `...ForConditionalGeneration` with its own vision tower, shrunk: a 2-layer vision
encoder on 28- to 32-pixel images, and the text model of `tiny_families` (4 layers, hidden 64).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from rayrunner.models.sources import SMOLLM2, resolve
from tests.families.tiny_families import COMMON, WINDOW

# ChatML like SmolLM2's own; an image part is written as the family's placeholder (`{image}` below)
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{image}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _tokenizer(tokens: list[str], **attributes: str) -> Any:
    """SmolLM2's tokenizer with `tokens` added, and `attributes` (e.g. `boi_token`) naming some of them."""
    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path, extra_special_tokens=attributes)
    tokenizer.add_tokens(tokens, special_tokens=True)
    return tokenizer


def _vocab(tokenizer: Any) -> int:
    return max(tokenizer.get_vocab().values()) + 1


def _text(model_type: str, vocab: int, **settings: Any) -> dict[str, Any]:
    return {**COMMON, "model_type": model_type, "vocab_size": vocab, "pad_token_id": 2, **settings}


def _save(folder: Path, config: Any, processor: Any) -> str:
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    for param in model.parameters():
        if param.dim() == 2 and not param.any():  # e.g. Gemma 3's projector starts at zero: images would not count
            with torch.no_grad():
                param.normal_(0, 1 / param.shape[0] ** 0.5)
    model.save_pretrained(str(folder))
    processor.save_pretrained(str(folder))
    return str(folder)


def llava(folder: Path) -> str:
    """LLaVA: a CLIP vision tower before a Llama."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tokenizer = _tokenizer(["<image>"])
    config = AutoConfig.for_model(
        "llava", vision_config=dict(model_type="clip_vision_model", image_size=32, patch_size=8, **VISION),
        text_config=_text("llama", _vocab(tokenizer)), image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        image_seq_length=16)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
        tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
        chat_template=TEMPLATE.replace("{image}", "<image>"))
    return _save(folder, config, processor)


def mistral3(folder: Path) -> str:
    """Mistral 3 (Mistral Small 3.x): a Pixtral vision tower before a Mistral with a sliding window."""
    from transformers import PixtralImageProcessorPil, PixtralProcessor

    tokenizer = _tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    config = AutoConfig.for_model(
        "mistral3", vision_config=dict(model_type="pixtral", image_size=32, patch_size=8, head_dim=16, **VISION),
        text_config=_text("mistral", _vocab(tokenizer), sliding_window=WINDOW),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        vision_feature_layer=-1)
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size=8), tokenizer=tokenizer,
        patch_size=8, spatial_merge_size=2, image_token="[IMG]", image_break_token="[IMG_BREAK]",
        image_end_token="[IMG_END]", chat_template=TEMPLATE.replace("{image}", "[IMG]"))
    return _save(folder, config, processor)


def gemma3(folder: Path) -> str:
    """Gemma 3: a SigLIP vision tower before a Gemma 3 text model (sliding and full layers)."""
    from transformers import Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = _tokenizer(["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
                           boi_token="<start_of_image>", image_token="<image_soft_token>", eoi_token="<end_of_image>")
    config = AutoConfig.for_model(
        "gemma3", vision_config=dict(model_type="siglip_vision_model", image_size=32, patch_size=8, **VISION),
        text_config=_text("gemma3_text", _vocab(tokenizer), sliding_window=WINDOW, sliding_window_pattern=2),
        mm_tokens_per_image=4, image_token_index=tokenizer.convert_tokens_to_ids("<image_soft_token>"),
        boi_token_index=tokenizer.convert_tokens_to_ids("<start_of_image>"),
        eoi_token_index=tokenizer.convert_tokens_to_ids("<end_of_image>"))
    processor = Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
        image_seq_length=4, chat_template=TEMPLATE.replace("{image}", "<start_of_image>"))
    return _save(folder, config, processor)


def qwen2_vl(folder: Path, model_type: str = "qwen2_vl") -> str:
    """Qwen2-VL (or Qwen2.5-VL with `model_type="qwen2_5_vl"`): a ViT with 2-D rotary positions before a Qwen2
    whose positions are 3-D (M-RoPE: time, height, width)."""
    from transformers import Qwen2VLImageProcessorPil

    tokenizer = _tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           [("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    vision: dict[str, Any] = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                                  spatial_merge_size=2, temporal_patch_size=2, in_chans=3)
    if model_type == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    text = _text(model_type + "_text" if model_type == "qwen2_5_vl" else "qwen2_vl_text", _vocab(tokenizer),
                 rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, **ids)
    text.pop("model_type")
    config = AutoConfig.for_model(model_type, vision_config=vision, text_config=text, **ids)
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor

    cls = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor
    processor = cls(image_processor=Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14,
                                                              merge_size=2, temporal_patch_size=2),
                    tokenizer=tokenizer,
                    chat_template=TEMPLATE.replace("{image}", "<|vision_start|><|image_pad|><|vision_end|>"))
    return _save(folder, config, processor)
