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


needs_own_kernel = pytest.mark.skipif(int8_rows.library() is None,
                                      reason="rayrunner's int8 kernel needs AVX-512 BF16 and a C compiler")


def _within_one_rounding(got: torch.Tensor, x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `got` is the exact product rounded to bf16, give or take one bf16 step (float32 sums' order)."""
    exact = (x.double() @ qdata.double().T) * scale.double()
    step = exact.abs().clamp_min(1e-30) * 2.0 ** -7
    return bool(((got.double() - exact).abs() <= step + 1e-6).all())


@needs_own_kernel
@pytest.mark.parametrize(("n", "k"), [(960, 576), (576, 1536), (4, 32), (49152, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
def test_own_kernel_is_the_exact_product_within_one_rounding(n: int, k: int, rows: int) -> None:
    qdata, scale = quantize_rows(randn(n, k))
    x = randn(rows, k, seed=1)
    got = int8_rows.few_rows_kernel(x, qdata, scale)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    assert _within_one_rounding(got, x, qdata, scale)
    # PyTorch's int8 kernel sums the same float32 products: the two differ by one bf16 step at most
    theirs = torch.ops.aten._weight_int8pack_mm(x, qdata, scale)
    assert relative_error(got, theirs) <= 2.0 ** -7


@needs_own_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_own_kernel_rows_are_the_same_alone_and_batched_on_any_threads(threads: int) -> None:
    qdata, scale = quantize_rows(randn(960, 576))
    wide = randn(16, 700, seed=2)
    x = wide[:, 100:676]  # rows a stride of 700 apart
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batched = int8_rows.few_rows_kernel(x, qdata, scale)
        alone = torch.cat([int8_rows.few_rows_kernel(x[row:row + 1], qdata, scale) for row in range(16)])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(batched, alone)
    assert _within_one_rounding(batched, x, qdata, scale)


def test_weights_the_own_kernel_cannot_take_go_to_pytorchs(monkeypatch: pytest.MonkeyPatch) -> None:
    qdata, scale = quantize_rows(randn(1002, 64))  # outputs not in blocks of 4
    x = randn(2, 64, seed=1)
    assert torch.equal(int8_rows.few_rows_kernel(x, qdata, scale), torch.ops.aten._weight_int8pack_mm(x, qdata, scale))
    monkeypatch.setenv(int8_rows.SWITCH_ENV, "0")
    int8_rows.library.cache_clear()
    try:
        assert int8_rows.library() is None
        qdata, scale = quantize_rows(randn(1000, 64))
        assert torch.equal(int8_rows.few_rows_kernel(x, qdata, scale),
                           torch.ops.aten._weight_int8pack_mm(x, qdata, scale))
    finally:
        monkeypatch.delenv(int8_rows.SWITCH_ENV)
        int8_rows.library.cache_clear()
