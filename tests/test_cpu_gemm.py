"""`cpu_gemm`: float32 prefill matmuls for half-precision Linears on CPUs without a native half GEMM."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rayrunner.quantization import cpu_gemm
from rayrunner.quantization.cpu_gemm import WideLinear, native_half_gemm, wide_dtype, widen_linears
from rayrunner.quantization.int8_rows import Int8Linear


@pytest.fixture
def no_native_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an AVX2-only CPU, whatever this one has."""
    monkeypatch.setattr(cpu_gemm, "native_half_gemm", lambda dtype: False)


def model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16, bias=False)).to(dtype)


def test_native_half_gemm_is_what_pytorch_says() -> None:
    assert native_half_gemm(torch.bfloat16) == torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert wide_dtype(torch.float32) == torch.float32


@pytest.mark.usefixtures("no_native_gemm")
def test_half_linears_widen_and_keep_their_state() -> None:
    net = model()
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    int8 = Int8Linear.from_linear(nn.Linear(64, 16).to(torch.bfloat16))
    net.append(int8)
    assert widen_linears(net) == 2
    assert [type(module) for module in net] == [WideLinear, nn.ReLU, WideLinear, Int8Linear]
    assert all(torch.equal(net.state_dict()[name], tensor) for name, tensor in before.items())
    assert widen_linears(model(torch.float32)) == 0  # float32 needs nothing


def test_nothing_widens_where_the_cpu_has_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_gemm, "native_half_gemm", lambda dtype: True)
    assert widen_linears(model()) == 0 and wide_dtype(torch.bfloat16) == torch.bfloat16


@pytest.mark.usefixtures("no_native_gemm")
def test_prefill_inputs_multiply_in_float32_and_decode_inputs_in_bf16() -> None:
    linear = model()[0]
    reference = nn.Linear(64, 32).to(torch.bfloat16)
    reference.load_state_dict(linear.state_dict())
    widen_linears(nn.Sequential(linear))
    x = torch.randn(3, 5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        prefill = linear(x)
        exact = (x.float() @ linear.weight.float().T + linear.bias.float()).to(torch.bfloat16)
        assert prefill.dtype == torch.bfloat16 and torch.equal(prefill, exact)
        for decode in (x[:, :1], x[:, 0]):  # one position per row, 3-D or 2-D (the fast decode step)
            assert torch.equal(linear(decode), reference(decode))


@pytest.mark.usefixtures("no_native_gemm")
def test_a_sequence_prefills_the_same_alone_and_batched() -> None:
    linear = model()[0]
    widen_linears(nn.Sequential(linear))
    prompts = torch.randn(4, 9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        batched = linear(prompts)
        assert all(torch.equal(linear(prompts[i:i + 1])[0], batched[i]) for i in range(4))
