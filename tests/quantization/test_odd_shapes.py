"""Every ISQ level on Linears a format cannot hold: each takes the next format that fits, or stays in the model's
dtype, the report lists which and why, and the model still generates (CPU, tiny random Llama)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rayrunner.quantization import VALID_NAMES, quantize_model

INT4 = {"Q4_0", "Q4_1", "Q2K", "Q3K", "Q4K", "HQQ4", "2", "3", "4"}
INT8_G32 = {"Q8_0", "Q8_1", "Q8K"}
LAYERS = 2
VOCAB = 1001  # an odd vocabulary, like 49,152 tokens plus an added one
INTERMEDIATE = 136  # not a multiple of 16 (CPU int4 rows) nor of 32 (groups)


def odd_llama(tied: bool = False, hidden: int = 64) -> Any:
    """A 2-layer Llama whose MLP and untied lm_head have shapes the grouped formats cannot hold."""
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=tied)
    model: Any = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return model(ids.to(model.device)).logits.float()


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


def expected_fallbacks(isq: str) -> dict[str, str]:
    """Layer name -> the format it falls back to, for `odd_llama` on CPU."""
    if isq in INT4:
        mlp = {f"model.layers.{i}.mlp.{name}": "int8 weight-only g32" for i in range(LAYERS)
               for name in ("gate_proj", "up_proj")}
        down = {f"model.layers.{i}.mlp.down_proj": "int8 weight-only per-channel" for i in range(LAYERS)}
        return {**mlp, **down, "lm_head": "int8 weight-only g32"}
    if isq in INT8_G32:
        return {f"model.layers.{i}.mlp.down_proj": "int8 weight-only per-channel" for i in range(LAYERS)}
    return {}


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return logits(odd_llama())


@pytest.mark.parametrize("isq", VALID_NAMES)
def test_every_level_quantizes_odd_shapes_and_still_generates(isq: str, reference: torch.Tensor) -> None:
    model = odd_llama()
    report = quantize_model(model, isq, "cpu")
    fallbacks = report["fallback_layers"]
    assert {name: entry["applied"].removeprefix("torchao ").removesuffix(" (CPU)")
            for name, entry in fallbacks.items()} == expected_fallbacks(isq)
    for name, entry in fallbacks.items():
        number = str(VOCAB) if name == "lm_head" else str(INTERMEDIATE)
        assert number in entry["reason"], entry
    assert report["skipped_layers"] == {}
    assert report["quantized_layers"] == LAYERS * 7 + 1
    assert all(type(m.weight.data) is not torch.Tensor for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert correlation(logits(model), reference) > 0.95
    with torch.inference_mode():
        out = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("isq", ["Q4K", "Q8_0", "8", "FP8"])
def test_a_linear_no_format_holds_stays_in_its_dtype_with_the_reason(isq: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Linear(16, 32)).to(torch.bfloat16)
    report = quantize_model(model, isq, "cpu")
    assert list(report["skipped_layers"]) == ["0"]
    assert "in_features 1" in report["skipped_layers"]["0"]
    assert type(model[0].weight.data) is torch.Tensor and model[0].weight.dtype == torch.bfloat16
    assert model(torch.ones(3, 1, dtype=torch.bfloat16)).shape == (3, 32)


def test_a_tied_pair_whose_rows_do_not_split_into_blocks_stays_in_its_dtype() -> None:
    base = odd_llama(tied=True, hidden=40)
    model = odd_llama(tied=True, hidden=40)
    report = quantize_model(model, "Q8_0", "cpu")
    assert report["tied_embedding_int8"] is False
    assert "40" in report["skipped_layers"]["lm_head"] and "tied" in report["skipped_layers"]["lm_head"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert correlation(logits(model), logits(base)) > 0.99


def test_already_quantized_layers_are_listed_as_skipped() -> None:
    model = odd_llama()
    quantize_model(model, "Q8_0", "cpu")
    again = quantize_model(model, "Q4K", "cpu")
    assert again["quantized_layers"] == 0 and again["fallback_layers"] == {}
    assert len(again["skipped_layers"]) == LAYERS * 7 + 1
    assert all("already quantized" in reason for reason in again["skipped_layers"].values())
