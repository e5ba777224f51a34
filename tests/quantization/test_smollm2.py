"""The real builtin SmolLM2 still answers a factual question after Q8_0 and Q4K quantization (greedy, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.quantization import quantize_model, weight_bytes

pytestmark = pytest.mark.slow  # loads and quantizes SmolLM2


@pytest.fixture(scope="module")
def folder() -> str:
    return resolve(SMOLLM2).path


@pytest.mark.parametrize(("isq", "max_ratio"), [("Q8_0", 0.62), ("Q4K", 0.45)])
def test_quantized_smollm2_knows_the_capital_of_france(folder: str, isq: str, max_ratio: float) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    base_bytes = weight_bytes(model)
    report = quantize_model(model, isq, "cpu")
    assert report["weight_bytes"] < max_ratio * base_bytes

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
