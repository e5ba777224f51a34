"""The fused decode attention (`decode_attention`): within one bf16 rounding of float32 attention over padding,
sliding windows, grouped heads and threads; refused cleanly; and a bf16 step with it decoding as transformers does.
Skipped without a C compiler or on CPUs without AVX-512 BF16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rayrunner.engines.transformers.step import decode_attention
from rayrunner.engines.transformers.step.fast_decode import FastDecode
from rayrunner.runtime import native_build
from tests.engines.test_fast_decode import _calls, _decode, _model, _relative
from tests.tiny_models import build_kernel_llama

needs_attention = pytest.mark.skipif(
    native_build.compiler() is None or not decode_attention.attends(torch.zeros(1, dtype=torch.bfloat16), 1, 64),
    reason="the fused decode attention needs a C compiler and a CPU with AVX-512 BF16")


def _room(rows: int, kv_heads: int, capacity: int, dim: int) -> torch.Tensor:
    """A cache's room as the batch holds it: rows of a larger tensor (rows left free), positions reserved ahead."""
    return (torch.randn(rows + 2, kv_heads, capacity, dim) * 2).to(torch.bfloat16)[:rows]


@needs_attention
# positions: one, a block of 16 and one past it, SmolLM2's wave (~160), a long row; groups 1-8 (chunks of 4 or 2)
@pytest.mark.parametrize("rows, kv_heads, group, dim, positions", [
    (1, 1, 1, 64, 1), (3, 3, 3, 64, 16), (16, 3, 3, 64, 17), (16, 3, 3, 64, 160), (2, 2, 5, 64, 700),
    (4, 2, 8, 128, 33), (5, 1, 3, 128, 130), (33, 3, 3, 64, 40)])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_is_float32_attention_within_bf16_rounding(rows: int, kv_heads: int, group: int, dim: int,
                                                                   positions: int, threads: int) -> None:
    torch.manual_seed(rows * positions + group)
    heads = kv_heads * group
    qkv = (torch.randn(rows, heads + 2 * kv_heads, dim)).to(torch.bfloat16)  # queries strided, as the step's are
    query = qkv[:, :heads].view(rows, kv_heads, group, dim)
    keys = _room(rows, kv_heads, positions + 20, dim)[:, :, :positions]
    values = _room(rows, kv_heads, positions + 20, dim)[:, :, :positions]
    bias = torch.zeros(rows, positions)
    bias[0, : positions // 3] = float("-inf")  # left padding
    if rows > 1:
        bias[1, : positions - 8] = float("-inf")  # a sliding window of 8
    bias = bias[:, None, None]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode_attention.decode_attention(query, keys, values, bias, dim ** -0.5)
    finally:
        torch.set_num_threads(previous)
    want = torch.nn.functional.scaled_dot_product_attention(
        query.float().reshape(rows, heads, 1, dim), keys.float(), values.float(), attn_mask=bias, scale=dim ** -0.5,
        enable_gqa=True).view(rows, kv_heads, group, dim)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    # one rounding to bf16 (half a unit in the last place, 2^-9 relative) plus float32 sums in another order
    assert torch.allclose(got.float(), want, rtol=2 ** -8, atol=1e-3)


@needs_attention
def test_decode_attention_refuses_what_it_was_not_built_for() -> None:
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert not decode_attention.attends(bf16, 3, 96) and not decode_attention.attends(bf16, 17, 64)
    assert not decode_attention.attends(torch.zeros(1), 3, 64)  # float32 keeps SDPA or the two matmuls
    query = torch.zeros(2, 1, 3, 64, dtype=torch.bfloat16)
    keys = torch.zeros(2, 1, 10, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bias"):
        decode_attention.decode_attention(query, keys, keys, torch.zeros(2, 1, 1, 9), 0.125)
    with pytest.raises(ValueError, match="keys"):
        decode_attention.decode_attention(query, keys, keys[:, :, :9], torch.zeros(2, 1, 1, 10), 0.125)
    with pytest.raises(ValueError, match="query"):
        decode_attention.decode_attention(torch.zeros(2, 1, 3, 96, dtype=torch.bfloat16), keys, keys,
                                   torch.zeros(2, 1, 1, 10), 0.125)


@needs_attention
@pytest.mark.slow
def test_a_bf16_step_with_the_fused_attention_decodes_as_transformers(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(build_kernel_llama(tmp_path), torch.bfloat16)
    fast = FastDecode.for_model(model)
    assert fast is not None
    calls = _calls(monkeypatch, decode_attention, "decode_attention")
    got, _ = _decode(model, fast, steps=6)
    assert len(calls) == 6 * 2  # every step, every layer
    want, _ = _decode(model, None, steps=6)  # transformers' forward
    for got_logits, want_logits in zip(got, want, strict=True):
        assert _relative(got_logits, want_logits) < 0.02
    assert [step.argmax(-1).tolist() for step in got] == [step.argmax(-1).tolist() for step in want]
