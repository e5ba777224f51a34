"""Short attention as two matmuls (`short_attention`): eager attention's results for a plain causal prompt, left-padded
rows (finite where a row attends to nothing), a chunk after cached positions, GQA and not; SDPA itself past the
limit and for what it does not cover; a CPU model on `sdpa` switched to it with the same logits."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from rayrunner.engines.transformers.short_attention import (
    MAX_SCORES,
    NAME,
    short_attention_forward,
    use_short_attention,
)
from tests.tiny_models import build_tiny_llama

SCALING = 0.125


def _inputs(batch: int, heads: int, kv_heads: int, q: int, kv: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(q * 1000 + kv)
    shapes = ((batch, heads, q, 64), (batch, kv_heads, kv, 64), (batch, kv_heads, kv, 64))
    return tuple(torch.randn(shape, generator=generator) for shape in shapes)


def _module(heads: int, kv_heads: int) -> SimpleNamespace:
    return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)


def _eager(module: SimpleNamespace, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           mask: torch.Tensor) -> torch.Tensor:
    bias = torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return eager_attention_forward(module, query, key, value, bias, scaling=SCALING)[0]  # type: ignore[arg-type]


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_a_causal_prompt_without_a_mask_gets_eager_attentions_result(heads: int, kv_heads: int) -> None:
    module = _module(heads, kv_heads)
    query, key, value = _inputs(1, heads, kv_heads, 12, 12)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    got = short_attention_forward(module, query, key, value, None, scaling=SCALING)[0]  # type: ignore[arg-type]
    torch.testing.assert_close(got, _eager(module, query, key, value, causal), atol=1e-5, rtol=1e-5)


def test_left_padded_rows_and_a_chunk_after_cached_positions_get_eager_attentions_result() -> None:
    module = _module(9, 3)
    query, key, value = _inputs(2, 9, 3, 5, 12)  # 5 new positions after 7 cached
    mask = torch.ones(5, 12, dtype=torch.bool).tril(7)[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :9] = False  # row 1 is left-padded: its first two new positions attend to nothing
    got = short_attention_forward(module, query, key, value, mask, scaling=SCALING)[0]  # type: ignore[arg-type]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, _eager(module, query, key, value, mask), atol=1e-5, rtol=1e-5)


def test_long_attention_and_what_it_does_not_cover_run_sdpa() -> None:
    module = _module(9, 3)
    side = int(MAX_SCORES ** 0.5) + 1
    for q, extra in ((side, {}), (4, {"output_attentions": True})):
        query, key, value = _inputs(1, 9, 3, q, q)
        got = short_attention_forward(module, query, key, value, None, scaling=SCALING,  # type: ignore[arg-type]
                                      **extra)[0]
        expected = sdpa_attention_forward(module, query, key, value, None, scaling=SCALING)[0]  # type: ignore[arg-type]
        assert torch.equal(got, expected)
    query, key, value = _inputs(1, 9, 3, 4, 4)
    with pytest.raises(ValueError, match="softcap"):  # sdpa's own refusal: soft capping is not covered here
        short_attention_forward(module, query, key, value, None, scaling=SCALING, softcap=30.0)  # type: ignore[arg-type]


def test_a_cpu_model_on_sdpa_switches_and_keeps_its_logits(tmp_path: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path), attn_implementation="sdpa").float().eval()
    ids = torch.tensor([[1, 5, 9, 14, 3, 8], [7, 2, 8, 4, 6, 1]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with torch.inference_mode():
        before = model(input_ids=ids, attention_mask=mask).logits
        assert use_short_attention(model) and model.config._attn_implementation == NAME
        after = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(after[real], before[real], atol=1e-4, rtol=1e-4)
    model.set_attn_implementation("eager")
    assert not use_short_attention(model)  # only a model on sdpa is switched
