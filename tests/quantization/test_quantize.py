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
        "fallback_layers": {},
        "skipped_layers": {},
        "tied_embedding_int8": True,
        "weight_bytes": weight_bytes(model),
    }
    assert report["weight_bytes"] < max_ratio * base_bytes
    assert correlation(logits(model), base_logits) > min_corr


def test_tied_embedding_and_lm_head_share_one_int8_table() -> None:
    model = tiny_llama()
    embedding = model.get_input_embeddings().weight.detach().clone()
    quantize_model(model, "Q4K", "cpu")
    table = model.get_input_embeddings().table
    assert model.get_output_embeddings().table is table
    assert table.qdata.dtype == torch.int8 and table.qdata.numel() == embedding.numel()
    ids = torch.tensor([[0, 7, 999]])
    looked_up = model.get_input_embeddings()(ids)
    assert looked_up.dtype == torch.bfloat16
    assert torch.allclose(looked_up.float(), embedding[ids].float(), atol=float(table.scale.max()))
    hidden = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    projected = model.get_output_embeddings()(hidden)
    assert projected.shape == (2, 3, 1000)
    assert correlation(projected, hidden.float() @ embedding.float().T) > 0.999
    assert sum(1 for name in model.state_dict() if name.endswith("qdata") and "table" in name) == 2  # one storage
    assert type(model.model.layers[0].mlp.down_proj.weight.data) is not torch.Tensor  # int4


def test_untied_lm_head_is_quantized_as_a_linear() -> None:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    model: Any = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    report = quantize_model(model, "Q8_0", "cpu")
    assert report["tied_embedding_int8"] is False
    assert report["quantized_layers"] == LINEARS_PER_LAYER + 1
    assert type(model.get_input_embeddings()) is torch.nn.Embedding


def test_report_is_json_serialisable() -> None:
    import json

    report = quantize_model(tiny_llama(), "q4k", "cpu")
    assert json.loads(json.dumps(report)) == report
    assert report["requested"] == "Q4K"


INT8_ROWS = "rayrunner int8 weight-only per-channel (CPU)"
INT4 = "torchao int4 weight-only g32 (CPU)"


@pytest.mark.parametrize(("isq", "exact", "applied"), [
    ("Q6K", False, INT8_ROWS), ("5", False, INT8_ROWS), ("Q2K", False, INT4), ("3", False, INT4),
    ("FP8", False, INT8_ROWS), ("HQQ8", True, INT8_ROWS), ("8", True, INT8_ROWS), ("Q8K", True, INT8_ROWS),
    ("Q8_0", True, INT8_ROWS), ("Q4_0", True, INT4),
])
def test_each_level_reports_what_was_applied(isq: str, exact: bool, applied: str) -> None:
    report = quantize_model(tiny_llama(), isq, "cpu")
    assert report["exact"] is exact
    assert report["applied"] == f"{applied}; tied embedding/lm_head int8 per-row"


def test_in_features_not_divisible_by_group_fall_back_to_per_channel_for_int4_only() -> None:
    def toy() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64)).to(torch.bfloat16)

    for isq, fallbacks in (("Q4_0", ["1"]), ("Q8_0", []), ("8", [])):
        report = quantize_model(toy(), isq, "cpu")
        assert report["quantized_layers"] == 2 and list(report["fallback_layers"]) == fallbacks, isq
        assert report["skipped_layers"] == {}, isq


def test_quantizing_twice_leaves_quantized_layers_alone() -> None:
    model = tiny_llama()
    quantize_model(model, "Q8_0", "cpu")
    again = quantize_model(model, "Q4K", "cpu")
    assert again["quantized_layers"] == 0
    assert len(again["skipped_layers"]) == 2 * LINEARS_PER_LAYER
    assert again["tied_embedding_int8"] is False


def test_unsupported_device_is_a_spec_error() -> None:
    with pytest.raises(InvalidSpecError, match="cpu or cuda"):
        quantize_model(tiny_llama(), "Q8_0", "mps")


def test_weight_bytes_counts_tied_storage_once() -> None:
    model = tiny_llama()
    unique = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() drops the tied copy
    naive = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    embedding = model.get_input_embeddings().weight
    assert weight_bytes(model) == unique == naive - embedding.numel() * embedding.element_size()


@pytest.mark.parametrize(("isq", "low", "high"), [("Q8_0", 1.0, 1.02), ("8", 1.0, 1.02), ("Q4K", 0.5, 0.65)])
def test_weight_bytes_counts_packed_data_and_scales(isq: str, low: float, high: float) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 512, bias=False)).to(torch.bfloat16)
    quantize_model(model, isq, "cpu")
    assert low * 256 * 512 < weight_bytes(model) < high * 256 * 512
