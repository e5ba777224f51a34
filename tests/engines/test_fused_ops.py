"""The fast decode step's fused bf16 operations (`fused_ops`): built with this machine's C compiler, rounded as the
PyTorch operations they replace, refused or switched off cleanly; and a bf16 decode step with them against one
without."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rayrunner.engines.transformers.step import fast_decode, fused_ops
from rayrunner.engines.transformers.step.fast_decode import FastDecode
from rayrunner.runtime import native_build
from tests.engines.test_fast_decode import _decode, _model, _relative

needs_compiler = pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler on this machine")


@pytest.fixture
def rebuilt() -> Iterator[None]:
    """`library()` looked up afresh in the test, and again after it (the test may change what it finds)."""
    fused_ops.library.cache_clear()
    yield
    fused_ops.library.cache_clear()


class _Norm(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter((torch.randn(width) * 0.2 + 1).to(torch.bfloat16))
        self.variance_epsilon = 1e-5


@needs_compiler
# widths: SmolLM2's 576; ones past PyTorch's 4-level summing cascade (4,096, 8,200 with a scalar tail); odd ones
@pytest.mark.parametrize("rows, width", [(1, 64), (16, 576), (3000, 576), (3, 960), (2, 100), (40, 4096),
                                         (20, 8200), (2, 20000)])
@pytest.mark.parametrize("with_addend", [True, False], ids=["add-and-norm", "norm"])
def test_add_rms_norm_rounds_as_pytorchs_operations(rows: int, width: int, with_addend: bool) -> None:
    assert fused_ops.library() is not None  # a compiler is here: the build must work
    torch.manual_seed(rows * width)
    norm = _Norm(width)
    hidden = (torch.randn(rows, width) * 3).to(torch.bfloat16)
    addend = (torch.randn(rows, width) * 2).to(torch.bfloat16) if with_addend else None
    mine, theirs = hidden.clone(), hidden.clone()
    with torch.inference_mode():
        got = fused_ops.add_rms_norm(mine, addend, norm.weight, norm.variance_epsilon)
        if addend is not None:
            theirs += addend
        want = fast_decode._rms_norm(norm, theirs)
    assert torch.equal(mine, theirs)  # the residual add, in place, exactly
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # to the bit: the mean summed in torch's order


@needs_compiler
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("qk_norms", [False, True], ids=["qkv-rows", "contiguous"])
def test_rope_rounds_as_pytorchs_operations(rows: int, qk_norms: bool) -> None:
    torch.manual_seed(rows)
    heads, kv_heads, dim = 9, 3, 64
    qkv = (torch.randn(rows, heads + 2 * kv_heads, dim) * 2).to(torch.bfloat16)
    x = qkv if not qk_norms else qkv[:, : heads + kv_heads].clone()  # Qwen3's normed heads: a tensor of their own
    angles = torch.randn(rows, 1, dim) * 5
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    sin = torch.cat([-sin[..., : dim // 2], sin[..., dim // 2:]], dim=-1)
    with torch.inference_mode():
        got = fused_ops.rope(x, heads + kv_heads, cos, sin)
        want = fast_decode._rope(x, heads + kv_heads, cos, sin, fused=False)
    assert got.shape == (rows, heads + kv_heads, dim)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@needs_compiler
@pytest.mark.parametrize("width", [1024, 1000], ids=["vectors", "a scalar tail"])
def test_silu_mul_rounds_as_pytorchs_operations_on_every_bf16_gate(width: int) -> None:
    gates = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every bf16 value
    gate = gates[: 64 * width].reshape(64, width)
    torch.manual_seed(width)
    up = (torch.randn(64, width) * 3).to(torch.bfloat16)
    gate_up = torch.cat([torch.zeros(64, 8, dtype=torch.bfloat16), gate, up], dim=1)[:, 8:]  # rows strided
    with torch.inference_mode():
        got = fused_ops.silu_mul(gate_up, width)
        want = torch.nn.functional.silu(gate).mul_(up)
    same = got.view(torch.int16) == want.view(torch.int16)
    both_nan = torch.isnan(got.float()) & torch.isnan(want.float())
    assert bool((same | both_nan).all())  # subnormals and infinities included


@needs_compiler
def test_silu_is_fused_only_where_its_vector_path_is_built() -> None:
    lib = fused_ops.library()
    assert lib is not None
    vectorized = bool(lib.silu_mul_vectorized())  # AVX-512 BF16 here: its scalar loop is slower than PyTorch's
    assert vectorized == ("avx512_bf16" in Path("/proc/cpuinfo").read_text())
    assert fused_ops.fuses_silu(torch.zeros(1, 8, dtype=torch.bfloat16)) == vectorized
    assert not fused_ops.fuses_silu(torch.zeros(1, 8))  # float32 keeps PyTorch's


@needs_compiler
def test_mismatched_tensors_are_refused_before_any_work() -> None:
    hidden = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="addend"):
        fused_ops.add_rms_norm(hidden, torch.zeros(2, 4, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16),
                               1e-5)
    with pytest.raises(ValueError, match="norm weight"):
        fused_ops.add_rms_norm(hidden, None, torch.ones(8), 1e-5)  # float32 weight on bf16 rows
    with pytest.raises(ValueError, match="RoPE table"):
        fused_ops.rope(torch.zeros(2, 4, 8, dtype=torch.bfloat16), 3, torch.zeros(2, 1, 4, dtype=torch.bfloat16),
                       torch.zeros(2, 1, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="gate and up"):
        fused_ops.silu_mul(torch.zeros(2, 10, dtype=torch.bfloat16), 4)
    with pytest.raises(ValueError, match="rotating"):
        fused_ops.rope(torch.zeros(2, 4, 8, dtype=torch.bfloat16), 5, torch.zeros(2, 1, 8, dtype=torch.bfloat16),
                       torch.zeros(2, 1, 8, dtype=torch.bfloat16))
    assert not fused_ops.applies(torch.zeros(2, 8))  # float32 rows keep PyTorch's operations
    with pytest.raises(ValueError, match="bf16 CPU tensors"):
        fused_ops.rope(torch.zeros(2, 4, 8), 3, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))


def test_switched_off_or_without_a_compiler_the_step_keeps_pytorchs_operations(
        rebuilt: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(fused_ops.SWITCH_ENV, "0")
    assert fused_ops.library() is None
    assert not fused_ops.applies(torch.zeros(1, 8, dtype=torch.bfloat16))
    fused_ops.library.cache_clear()
    monkeypatch.delenv(fused_ops.SWITCH_ENV)
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    assert fused_ops.library() is None  # the build failed: logged, not raised


@needs_compiler
def test_a_fresh_cache_builds_the_library_once(rebuilt: None, monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path))
    assert fused_ops.library() is not None
    built = list((tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    fused_ops.library.cache_clear()
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # a built library needs no compiler
    assert fused_ops.library() is not None


@needs_compiler
@pytest.mark.slow
def test_a_bf16_step_with_fused_operations_decodes_as_without(tiny_llama_dir: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(tiny_llama_dir, torch.bfloat16)
    fast = FastDecode.for_model(model)
    assert fast is not None and fused_ops.applies(torch.zeros(1, 8, dtype=torch.bfloat16))
    got, _ = _decode(model, fast, steps=6)
    monkeypatch.setattr(fused_ops, "applies", lambda hidden: False)
    want, _ = _decode(model, fast, steps=6)
    for got_logits, want_logits in zip(got, want, strict=True):
        assert _relative(got_logits, want_logits) < 0.02
    assert [step.argmax(-1).tolist() for step in got] == [step.argmax(-1).tolist() for step in want]

