"""Each plan's shape check, CUDA's included: checks read only shapes and dtypes, so they run on CPU Linears."""

from __future__ import annotations

import pytest
import torch

from rayrunner.quantization import parse_isq
from rayrunner.quantization.torchao_backend import plans_for

SM90 = (9, 0)


def linear(in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Linear:
    return torch.nn.Linear(in_features, out_features, device="meta", dtype=dtype)


def check(misfit: str | None, why: str | None) -> None:
    """`misfit` is None when `why` is, else it mentions `why`."""
    assert misfit is None if why is None else why in str(misfit), misfit


def chain(isq: str, device_type: str, capability: tuple[int, int] | None = None) -> list[str]:
    return [plan.applied for plan in plans_for(parse_isq(isq), device_type, capability)]


def test_each_level_falls_back_towards_per_channel_int8() -> None:
    assert chain("Q4K", "cpu") == ["torchao int4 weight-only g32 (CPU)", "rayrunner int8 weight-only per-channel (CPU)"]
    assert chain("Q4K", "cuda", SM90) == ["torchao int4 weight-only g32 (CUDA)", "torchao int8 weight-only g32 (CUDA)",
                                          "torchao int8 weight-only per-channel (CUDA)"]
    assert chain("Q8_0", "cuda", SM90) == ["torchao int8 weight-only g32 (CUDA)",
                                           "torchao int8 weight-only per-channel (CUDA)"]
    for isq in ("Q8_0", "Q6K", "8", "FP8"):
        assert chain(isq, "cpu") == ["rayrunner int8 weight-only per-channel (CPU)"]
    assert chain("FP8", "cuda", SM90) == ["torchao float8 e4m3 weight-only (CUDA)"]


@pytest.mark.parametrize(("shape", "dtype", "why"), [
    ((64, 49153), torch.bfloat16, "out_features 49153 is not a multiple of 16"),
    ((64, 17), torch.float32, "out_features 17 is not a multiple of 16"),
    ((50, 64), torch.bfloat16, "in_features 50 is not a multiple of the group size 32"),
    ((96, 48), torch.float16, None),
])
def test_cpu_int4_needs_rows_in_16s_and_whole_groups(shape: tuple[int, int], dtype: torch.dtype,
                                                     why: str | None) -> None:
    check(plans_for(parse_isq("Q4K"), "cpu")[0].misfit(linear(*shape, dtype)), why)


@pytest.mark.parametrize(("shape", "dtype", "capability", "why"), [
    ((64, 49153), torch.bfloat16, SM90, None),  # tinygemm pads rows to 8 and in_features to 1024 itself
    ((64, 17), torch.bfloat16, (8, 0), None),
    ((33, 64), torch.bfloat16, SM90, "in_features 33 is not a multiple of the group size 32"),
    ((64, 64), torch.float16, SM90, "bfloat16"),
    ((64, 64), torch.bfloat16, (7, 5), "compute capability"),
])
def test_cuda_int4_needs_whole_groups_bf16_and_sm80(shape: tuple[int, int], dtype: torch.dtype,
                                                    capability: tuple[int, int], why: str | None) -> None:
    check(plans_for(parse_isq("Q4K"), "cuda", capability)[0].misfit(linear(*shape, dtype)), why)


@pytest.mark.parametrize(("isq", "device_type"), [("8", "cuda"), ("FP8", "cuda")])
def test_cuda_per_channel_formats_hold_any_shape_but_a_single_column(isq: str, device_type: str) -> None:
    plan = plans_for(parse_isq(isq), device_type, SM90)[0]
    assert plan.misfit(linear(33, 49153)) is None and plan.misfit(linear(2, 3)) is None
    assert "in_features 1" in str(plan.misfit(linear(1, 16)))


def test_cpu_int8_rows_hold_any_shape() -> None:
    plan = plans_for(parse_isq("Q8_0"), "cpu")[0]
    assert all(plan.misfit(linear(*shape)) is None for shape in [(33, 49153), (2, 3), (1, 16)])
