"""`int8_matmul` and `Int8Linear`: int8 weights with one scale per row, against their dequantized reference (CPU)."""

from __future__ import annotations

import pytest
import torch

from rayrunner.quantization import int8_rows
from rayrunner.quantization.int8_rows import Int8Linear, dequantize_rows, int8_matmul, quantize_rows


def randn(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize(("rows", "in_features", "dtype"), [
    (1, 64, torch.bfloat16),  # the int8 kernel
    (16, 576, torch.bfloat16),  # the int8 kernel, at its most rows
    (17, 64, torch.bfloat16),  # the conversion path
    (3, 40, torch.bfloat16),  # in_features the kernel cannot take (it gave garbage): conversion
    (1, 33, torch.bfloat16),  # ... or crashed: conversion
    (2, 64, torch.float16),  # the kernel is slow on float16 and float32: conversion
    (2, 64, torch.float32),
])
def test_matmul_matches_the_dequantized_weight(rows: int, in_features: int, dtype: torch.dtype) -> None:
    qdata, scale = quantize_rows(randn(1001, in_features, dtype=dtype))
    x = randn(rows, in_features, dtype=dtype, seed=1)
    got = int8_matmul(x, qdata, scale)
    assert got.shape == (rows, 1001) and got.dtype == dtype
    assert relative_error(got, x.float() @ dequantize_rows(qdata, scale).float().T) < 0.01


def test_conversion_in_chunks_matches_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    qdata, scale = quantize_rows(randn(100, 64))
    x = randn(2, 20, 64, seed=1)  # 40 rows: the conversion path
    whole = int8_matmul(x, qdata, scale)
    monkeypatch.setattr(int8_rows, "CONVERT_ROWS", 7)
    assert torch.equal(int8_matmul(x, qdata, scale), whole) and whole.shape == (2, 20, 100)


def test_quantize_rows_in_chunks_matches_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = randn(100, 64)
    whole = quantize_rows(weight)
    monkeypatch.setattr(int8_rows, "ROWS_PER_CHUNK", 7)
    chunked = quantize_rows(weight)
    assert all(torch.equal(a, b) for a, b in zip(whole, chunked, strict=True))


def test_rows_round_within_half_a_step_and_zero_rows_stay_zero() -> None:
    weight = randn(50, 96)
    weight[7] = 0
    qdata, scale = quantize_rows(weight)
    assert qdata.dtype == torch.int8 and int(qdata.abs().max()) == 127 and scale.dtype == torch.bfloat16
    error = (qdata.float() * scale.float()[:, None] - weight.float()).abs()
    assert bool((error <= 0.5 * scale.float()[:, None] + 1e-6).all())
    assert not bool(qdata[7].any()) and bool(torch.isfinite(scale).all())


@pytest.mark.parametrize("rows", [1, 32])
def test_int8_linear_replaces_a_linear_with_its_bias(rows: int) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    original = linear.weight.detach().clone()
    quantized = Int8Linear.from_linear(linear)
    assert torch.equal(linear.weight, original)  # the source Linear is left as it was
    assert (quantized.in_features, quantized.out_features) == (64, 48)
    x = randn(2, rows, 64, seed=1)
    with torch.inference_mode():
        got, want = quantized(x), linear(x)
    assert got.shape == want.shape == (2, rows, 48)
    assert relative_error(got, want) < 0.02


def test_linears_reading_one_input_share_one_tensor() -> None:
    linears = [Int8Linear(*quantize_rows(randn(rows, 64, seed=rows)), None) for rows in (48, 16, 16)]
    x = randn(3, 64, seed=9)
    alone = [linear(x) for linear in linears]
    shared = int8_rows.share_storage(linears)
    assert shared is not None
    qdata, scale = shared
    assert qdata.shape == (80, 64) and scale.shape == (80,)
    assert all(linear.qdata.untyped_storage().data_ptr() == qdata.untyped_storage().data_ptr() for linear in linears)
    assert torch.equal(int8_matmul(x, qdata, scale), torch.cat(alone, dim=-1))
    assert all(torch.equal(linear(x), out) for linear, out in zip(linears, alone, strict=True))
    assert int8_rows.share_storage(linears) is None  # already views: left as they are


def test_linears_with_a_bias_or_other_widths_keep_their_own_tensors() -> None:
    with_bias = [Int8Linear(*quantize_rows(randn(16, 64)), randn(16)), Int8Linear(*quantize_rows(randn(16, 64)), None)]
    widths = [Int8Linear(*quantize_rows(randn(16, 64)), None), Int8Linear(*quantize_rows(randn(16, 32)), None)]
    for linears in (with_bias, widths):
        before = [linear.qdata for linear in linears]
        assert int8_rows.share_storage(linears) is None
        assert all(linear.qdata is tensor for linear, tensor in zip(linears, before, strict=True))
