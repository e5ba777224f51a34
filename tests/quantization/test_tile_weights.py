"""bf16 weights packed for AMX tiles (`tile_weights`): unpacked exactly, multiplied as oneDNN multiplies (to the bit
for a decode step's rows, within bf16 rounding of float32 for a prompt's), each row independent of the others,
refused cleanly, and chosen by `packed_linear` only where the kernel is built. Skipped on CPUs without AMX."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from rayrunner.quantization import packed_linear, tile_weights
from rayrunner.quantization.packed_linear import OneDnnWeight, PackedLinear, pack_linears
from rayrunner.quantization.tile_weights import TileWeight

needs_tiles = pytest.mark.skipif(tile_weights.library() is None,
                                 reason="the tile kernel needs a CPU with AMX tiles and a C compiler")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return (torch.randn(n, k) * 0.05).to(torch.bfloat16)


@needs_tiles
# groups of 6 (SmolLM2's shapes), 5, 4 (Llama's 4,096) and 1 block of 16 outputs
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (160, 64), (4096, 256), (112, 32)])
def test_a_packed_weight_unpacks_exactly(n: int, k: int) -> None:
    weight = _weight(n, k)
    packed = TileWeight(weight)
    assert packed.group == next(size for size in (6, 5, 4, 3, 2, 1) if (n // 16) % size == 0)
    assert torch.equal(packed.dense(), weight) and packed.nbytes == weight.numel() * 2


@needs_tiles
@pytest.mark.parametrize("n, k", [(960, 576), (576, 1536), (160, 64), (112, 32)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300, 1100])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_multiply_is_onednns_for_decode_rows_and_float32_within_rounding(n: int, k: int, rows: int,
                                                                         with_bias: bool) -> None:
    weight = _weight(n, k, seed=rows)
    bias = (torch.randn(n) * 0.5).to(torch.bfloat16) if with_bias else None
    wide = torch.randn(rows, k + 64).to(torch.bfloat16)
    x = wide[:, 32: 32 + k]  # rows strided, as a slice of a wider activation
    got = TileWeight(weight).multiply(x, bias)
    want = (x.float() @ weight.float().T + (0 if bias is None else bias.float()))
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-3)  # float32 sums, one bf16 rounding
    if rows <= 16:  # oneDNN sums a few rows in the same order: the same bits
        onednn = OneDnnWeight(weight).multiply(x.contiguous(), bias)
        assert torch.equal(got.view(torch.int16), onednn.view(torch.int16))


@needs_tiles
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_is_the_same_alone_or_in_any_batch(threads: int) -> None:
    packed = TileWeight(_weight(576, 576))
    x = torch.randn(2, 21, 576).to(torch.bfloat16)  # a batch of two prompts of 21 tokens
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = packed.multiply(x, None)
        alone = [packed.multiply(x[i, j: j + 1], None) for i in range(2) for j in range(21)]
    finally:
        torch.set_num_threads(previous)
    assert together.shape == (2, 21, 576)
    assert torch.equal(together.reshape(42, 576), torch.cat(alone))


@needs_tiles
@pytest.mark.parametrize("n, k", [(3072, 576), (192, 64), (128, 32)])  # SmolLM2's gate/up; groups of 6, 4
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 33, 300, 1100])
@pytest.mark.parametrize("threads", [1, 2])
def test_glu_is_silu_mul_of_the_matmul_to_the_bit(n: int, k: int, rows: int, threads: int) -> None:
    from rayrunner.engines.transformers.step import fused_ops

    combiner = fused_ops.silu_sums()
    if combiner is None:
        pytest.skip("SiLU times up is fused only with AVX-512 BF16")
    packed = TileWeight(_weight(n, k, seed=rows) * 20)  # sums over the SiLU's whole range, tiny ones too
    x = torch.randn(rows, k + 32).to(torch.bfloat16)[:, 32:]  # rows strided
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = packed.glu(x, combiner)
        want = fused_ops.silu_mul(packed.multiply(x, None), n // 2)
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (rows, n // 2)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_tiles
def test_what_does_not_fit_is_refused() -> None:
    assert not tile_weights.packs(_weight(100, 64))  # outputs not a multiple of 16
    assert not tile_weights.packs(_weight(96, 48))  # inputs not a multiple of 32
    assert not tile_weights.packs(torch.zeros(96, 64))  # float32
    with pytest.raises(ValueError, match="cannot be packed"):
        TileWeight(torch.zeros(96, 64))
    packed = TileWeight(_weight(96, 64))
    with pytest.raises(ValueError, match="input"):
        packed.multiply(torch.zeros(2, 64), None)  # float32 rows
    with pytest.raises(ValueError, match="input"):
        packed.multiply(torch.zeros(2, 32, dtype=torch.bfloat16), None)
    assert packed.multiply(torch.zeros(0, 64, dtype=torch.bfloat16), None).shape == (0, 96)
    assert not packed.halves  # six blocks of 16 outputs in one group: no halves of whole groups
    with pytest.raises(ValueError, match="halves"):
        packed.glu(torch.zeros(2, 64, dtype=torch.bfloat16), 0)


@needs_tiles
def test_linears_are_packed_for_the_tiles_where_they_fit_and_for_onednn_elsewhere() -> None:
    owner = nn.Module()
    owner.tiled = nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
    owner.odd = nn.Linear(48, 96, bias=False, dtype=torch.bfloat16)  # 48 inputs: oneDNN
    assert pack_linears(owner) == 2
    assert isinstance(owner.tiled, PackedLinear) and isinstance(owner.tiled.packed, TileWeight)
    assert isinstance(owner.odd.packed, OneDnnWeight)


def test_switched_off_every_weight_is_packed_for_onednn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(tile_weights.SWITCH_ENV, "0")
    tile_weights.library.cache_clear()
    try:
        assert tile_weights.library() is None and not tile_weights.packs(_weight(96, 64))
        linear = nn.Linear(64, 96, bias=False, dtype=torch.bfloat16)
        if packed_linear.packing_pays():
            pack_linears(linear)
            assert isinstance(linear, PackedLinear) and isinstance(linear.packed, OneDnnWeight)
    finally:
        tile_weights.library.cache_clear()
