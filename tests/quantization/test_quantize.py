"""`quantize_model` and `weight_bytes` on a tiny random Llama with tied embeddings (bf16, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rayrunner.errors import InvalidSpecError
from rayrunner.quantization import quantize_model, weight_bytes

LINEARS_PER_LAYER = 7  # q k v o gate up down


def tiny_llama() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    model: Any = LlamaForCausalLM(config)
    return model.to(torch.bfloat16).eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        return model(ids).logits.float()


def correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])


@pytest.fixture(scope="module")
def reference() -> tuple[int, torch.Tensor]:
    model = tiny_llama()
    return weight_bytes(model), logits(model)


@pytest.mark.parametrize(("isq", "max_ratio", "min_corr"), [("Q8_0", 0.75, 0.999), ("Q4K", 0.6, 0.98)])
def test_quantize_shrinks_weights_and_keeps_logits(isq: str, max_ratio: float, min_corr: float,
                                                   reference: tuple[int, torch.Tensor]) -> None:
    base_bytes, base_logits = reference
    model = tiny_llama()
    report = quantize_model(model, isq, "cpu")
    assert report == {
        "requested": isq,
        "applied": report["applied"],
        "exact": True,
        "quantized_layers": 2 * LINEARS_PER_LAYER,
        "skipped_layers": 1,  # the tied lm_head
        "weight_bytes": weight_bytes(model),
    }
    assert report["weight_bytes"] < max_ratio * base_bytes
    assert correlation(logits(model), base_logits) > min_corr


def test_tied_lm_head_stays_tied_and_plain() -> None:
    model = tiny_llama()
    quantize_model(model, "Q4K", "cpu")
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert type(model.lm_head.weight.data) is torch.Tensor
    assert type(model.model.layers[0].mlp.down_proj.weight.data) is not torch.Tensor


def test_report_is_json_serialisable() -> None:
    import json

    report = quantize_model(tiny_llama(), "q4k", "cpu")
    assert json.loads(json.dumps(report)) == report
    assert report["requested"] == "Q4K"


@pytest.mark.parametrize(("isq", "exact", "bits"), [("Q6K", False, 8), ("5", False, 8), ("Q2K", False, 4),
                                                   ("3", False, 4), ("FP8", False, 8), ("HQQ8", True, 8)])
def test_nearest_substitutes_are_not_exact(isq: str, exact: bool, bits: int) -> None:
    report = quantize_model(tiny_llama(), isq, "cpu")
    assert report["exact"] is exact
    assert f"int{bits}" in report["applied"]


def test_in_features_not_divisible_by_group_are_skipped_for_int4_only() -> None:
    def toy() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64)).to(torch.bfloat16)

    int4 = quantize_model(toy(), "Q4_0", "cpu")
    int8 = quantize_model(toy(), "Q8_0", "cpu")
    assert (int4["quantized_layers"], int4["skipped_layers"]) == (1, 1)
    assert (int8["quantized_layers"], int8["skipped_layers"]) == (2, 0)


def test_quantizing_twice_leaves_quantized_layers_alone() -> None:
    model = tiny_llama()
    quantize_model(model, "Q8_0", "cpu")
    again = quantize_model(model, "Q4K", "cpu")
    assert again["quantized_layers"] == 0
    assert again["skipped_layers"] == 2 * LINEARS_PER_LAYER + 1


def test_unsupported_device_is_a_spec_error() -> None:
    with pytest.raises(InvalidSpecError, match="cpu or cuda"):
        quantize_model(tiny_llama(), "Q8_0", "mps")


def test_weight_bytes_counts_tied_storage_once() -> None:
    model = tiny_llama()
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() drops the tied copy
    naive = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    embedding = model.get_input_embeddings().weight
    assert weight_bytes(model) == unique == naive - embedding.numel() * embedding.element_size()


@pytest.mark.parametrize(("isq", "low", "high"), [("Q8_0", 1.0, 1.1), ("Q4K", 0.5, 0.65)])
def test_weight_bytes_counts_packed_data_and_scales(isq: str, low: float, high: float) -> None:
    linear = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)
    quantize_model(linear, isq, "cpu")
    assert low * 256 * 512 < weight_bytes(linear) < high * 256 * 512
