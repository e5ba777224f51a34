"""`Int8Table` and `quantize_tied_embedding`: one int8 copy serving lookups and the lm_head (CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

from rayrunner.quantization.tied_embedding import Int8Table, quantize_tied_embedding, tied_head_misfit


def weight(rows: int, dim: int) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)


@pytest.mark.parametrize("dim", [96, 40, 1])
def test_table_round_trips_within_half_a_step(dim: int) -> None:
    original = weight(50, dim)
    table = Int8Table.from_weight(original)
    assert table.qdata.shape == (50, dim) and table.scale.shape == (50,)
    error = (table.dequantize().float() - original.float()).abs()
    bf16_rounding = original.float().abs() * 2**-7  # the bf16 scale and the bf16 result
    assert bool((error <= 0.5 * table.scale.float()[:, None] + bf16_rounding + 1e-6).all())


def test_rows_and_projection_agree_with_the_dequantized_table() -> None:
    table = Int8Table.from_weight(weight(300, 64))
    dense = table.dequantize().float()
    ids = torch.tensor([[3, 299], [0, 3]])
    assert torch.equal(table.rows(ids), table.dequantize()[ids])
    for rows in (1, 40):  # the int8 kernel, then the conversion path
        hidden = torch.randn(2, rows, 64).to(torch.bfloat16)
        logits = table.project(hidden)
        assert logits.shape == (2, rows, 300) and logits.dtype == torch.bfloat16  # like an unquantized head
        exact = hidden.float() @ dense.T
        assert float((logits.float() - exact).abs().max()) < 0.01 * float(exact.abs().max())


def tiny_tied_llava() -> Any:
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=200, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=199, image_seq_length=16,
                         tie_word_embeddings=True)
    return LlavaForConditionalGeneration(config).to(torch.bfloat16).eval()


def test_a_tied_multimodal_model_still_runs_with_images() -> None:
    model = tiny_tied_llava()
    ids = torch.tensor([[1, *[199] * 16, 5, 6]])
    pixels = torch.randn(1, 3, 32, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = model(input_ids=ids, pixel_values=pixels).logits.float()
    assert quantize_tied_embedding(model) is True
    with torch.inference_mode():
        after = model(input_ids=ids, pixel_values=pixels).logits.float()
    assert float(torch.corrcoef(torch.stack([before.flatten(), after.flatten()]))[0, 1]) > 0.99


def test_untied_or_scaled_embeddings_are_left_alone() -> None:
    plain = torch.nn.Linear(8, 8)
    assert quantize_tied_embedding(plain) is False  # no get_input_embeddings at all

    class Scaled(torch.nn.Embedding):
        """Like Gemma's scaled embedding: a subclass whose lookup is not a plain gather."""

    model = tiny_tied_llava()
    language = model.get_input_embeddings()
    scaled = Scaled(language.num_embeddings, language.embedding_dim)
    scaled.weight = language.weight
    model.set_input_embeddings(scaled)
    assert quantize_tied_embedding(model) is False
    assert model.get_input_embeddings() is scaled


def test_a_tied_head_the_table_cannot_hold_is_named_with_the_reason() -> None:
    model = tiny_tied_llava()
    assert tied_head_misfit(model) is None
    model.to("meta")  # not on CPU
    misfit = tied_head_misfit(model)
    assert misfit is not None and misfit[0] is model.get_output_embeddings() and "CPU-only" in misfit[1]
    assert quantize_tied_embedding(model) is False
    assert tied_head_misfit(torch.nn.Linear(8, 8)) is None
