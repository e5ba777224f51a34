"""Tiny random-weight models saved to a folder, so engine tests run in seconds with no download.

Both reuse the SmolLM2 tokenizer (a builtin converted once to `~/.cache/rayrunner`). The weights are random, so the
text they generate is gibberish, but it is deterministic under greedy decoding and depends on the whole input. The
output head is not tied to the embeddings: tied random weights make the model repeat its last input token forever,
whatever else (an image, say) the prompt holds.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from rayrunner.models.sources import SMOLLM2, resolve

IMAGE_TOKEN = "<image>"
ODD_HEAD_SIZE = 49_153  # SmolLM2's 49,152 tokens plus the added `<image>`

# ChatML like SmolLM2's own, with content given as a string or as a list of text / image parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(with_image_token: bool) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)
    if with_image_token:
        tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _text_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )


def build_tiny_llama(path: str | Path, seed: int = 0) -> str:
    """A 2-layer Llama text model (bf16) with the SmolLM2 tokenizer and chat template; returns the folder. Weights
    are the same for the same `seed` (content-keyed caches, such as the quantized model cache, then hit)."""
    torch.manual_seed(seed)
    tokenizer = _tokenizer(with_image_token=False)
    model = LlamaForCausalLM(_text_config(len(tokenizer))).to(torch.bfloat16)
    model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return str(path)


def build_tiny_llava(path: str | Path) -> str:
    """A LLaVA model (2-layer CLIP vision tower + 2-layer Llama) with a PIL-only processor; returns the folder."""
    torch.manual_seed(0)
    tokenizer = _tokenizer(with_image_token=True)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=_text_config(len(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(32 // 8) ** 2,
    )
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    model.save_pretrained(str(path))
    processor.save_pretrained(str(path))
    return str(path)


def build_tiny_llava_odd_head(path: str | Path) -> str:
    """`build_tiny_llava`, checked to hold the case that once failed Q4K: an untied lm_head of 49,153 outputs (the
    text vocabulary plus the added `<image>` token), which the CPU int4 kernel cannot pack (it needs rows in 16s)."""
    folder = build_tiny_llava(path)
    text: Any = LlavaConfig.from_pretrained(folder).text_config
    if text.vocab_size != ODD_HEAD_SIZE or text.tie_word_embeddings:
        raise RuntimeError(f"expected an untied head of {ODD_HEAD_SIZE} outputs, got {text.vocab_size}")
    return folder


def image_data_url(image: Image.Image, fmt: str = "PNG") -> str:
    """`image` as a `data:image/...;base64,...` URL, as an OpenAI client sends it."""
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def build_kernel_llama(path: str | Path, seed: int = 0) -> str:
    """A 2-layer random bf16 Llama with no tokenizer, shaped for rayrunner's CPU kernels (three heads of 64 sharing one
    KV head, widths the AMX tiles take); returns the folder."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=192, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=512)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(path))
    return str(path)
