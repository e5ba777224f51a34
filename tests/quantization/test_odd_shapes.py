"""Every ISQ level on Linears a format cannot hold: each takes the next format that fits, or stays in the model's
dtype, the report lists which and why, and the model still generates (CPU, tiny random Llama; CUDA's chains are
checked on CPU modules, since checks read only shapes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rayrunner.quantization import VALID_NAMES, parse_isq, quantize_model
from rayrunner.quantization.torchao_backend import assign_layers, plans_for

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
    """Layer name -> the format it falls back to, for `odd_llama` on CPU (only int4 has shape needs there)."""
    if isq not in INT4:
        return {}
    odd = [f"model.layers.{i}.mlp.{name}" for i in range(LAYERS) for name in ("gate_proj", "up_proj", "down_proj")]
    return {name: "rayrunner int8 weight-only per-channel (CPU)" for name in [*odd, "lm_head"]}


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return logits(odd_llama())


@pytest.mark.parametrize("isq", VALID_NAMES)
def test_every_level_quantizes_odd_shapes_and_still_generates(isq: str, reference: torch.Tensor) -> None:
    model = odd_llama()
    report = quantize_model(model, isq, "cpu")
    fallbacks = report["fallback_layers"]
    assert {name: entry["applied"] for name, entry in fallbacks.items()} == expected_fallbacks(isq)
    for name, entry in fallbacks.items():
        number = str(VOCAB) if name == "lm_head" else str(INTERMEDIATE)
        assert number in entry["reason"], entry
    assert report["skipped_layers"] == {}
    assert report["quantized_layers"] == LAYERS * 7 + 1
    assert not any(isinstance(m, torch.nn.Linear) and type(m.weight.data) is torch.Tensor for m in model.modules())
    assert correlation(logits(model), reference) > 0.95
    with torch.inference_mode():
        out = model.generate(torch.tensor([[1, 5, 9]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.parametrize("isq", ["Q4K", "Q8_0", "8", "FP8"])
def test_cpu_int8_holds_any_shape_even_a_single_column(isq: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Linear(16, 33)).to(torch.bfloat16)
    x = torch.linspace(-1, 1, 3, dtype=torch.bfloat16)[:, None]
    with torch.inference_mode():
        before = model(x)
    report = quantize_model(model, isq, "cpu")
    assert report["skipped_layers"] == {} and report["quantized_layers"] == 2
    with torch.inference_mode():
        assert correlation(model(x), before) > 0.99


@pytest.mark.parametrize("isq", ["Q4K", "Q8_0", "8", "FP8"])
def test_a_linear_no_cuda_format_holds_stays_in_its_dtype_with_the_reason(isq: str) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(1, 16), torch.nn.Linear(16, 32)).to(torch.bfloat16)
    layers = assign_layers(model, plans_for(parse_isq(isq), "cuda", (9, 0)))
    assert list(layers.skipped) == ["0"] and "in_features 1" in layers.skipped["0"]
    assert list(layers.formats) == ["1"]


def test_a_bare_linear_is_not_quantized_in_place() -> None:
    report = quantize_model(torch.nn.Linear(64, 64), "Q8_0", "cpu")
    assert report["quantized_layers"] == 0 and "the model itself" in report["skipped_layers"][""]


def test_a_tied_pair_of_any_width_shares_one_int8_table() -> None:
    base = odd_llama(tied=True, hidden=40)  # 40 columns: not a multiple of the int8 kernel's 16
    model = odd_llama(tied=True, hidden=40)
    report = quantize_model(model, "Q8_0", "cpu")
    assert report["tied_embedding_int8"] is True and report["skipped_layers"] == {}
    assert model.get_output_embeddings().table is model.get_input_embeddings().table
    assert correlation(logits(model), logits(base)) > 0.99


@pytest.mark.parametrize(("first", "why"), [("Q8_0", "Int8Linear"), ("Q4K", "Int4")])
def test_already_quantized_layers_are_listed_as_skipped(first: str, why: str) -> None:
    model = odd_llama()
    quantize_model(model, first, "cpu")
    again = quantize_model(model, "Q4K", "cpu")
    assert again["quantized_layers"] == 0 and again["fallback_layers"] == {}
    assert len(again["skipped_layers"]) == LAYERS * 7 + 1
    assert all("already quantized" in reason for reason in again["skipped_layers"].values())
    assert any(why in reason for reason in again["skipped_layers"].values())
