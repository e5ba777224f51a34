"""Every ISQ level on odd-shaped Linears on CUDA (skipped without a GPU): tinygemm int4 pads rows itself, so only
in_features off the group size fall back."""

from __future__ import annotations

import pytest
import torch

from rayrunner.quantization import VALID_NAMES, quantize_model
from tests.quantization.test_odd_shapes import INT4, INT8_G32, LAYERS, correlation, logits, odd_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("isq", VALID_NAMES)
def test_every_level_quantizes_odd_shapes_on_cuda(isq: str) -> None:
    reference = logits(odd_llama().cuda()).cpu()
    model = odd_llama().cuda()
    report = quantize_model(model, isq, "cuda")
    downs = {f"model.layers.{i}.mlp.down_proj" for i in range(LAYERS)} if isq in INT4 | INT8_G32 else set()
    assert set(report["fallback_layers"]) == downs
    assert report["skipped_layers"] == {} and report["quantized_layers"] == LAYERS * 7 + 1
    assert correlation(logits(model).cpu(), reference) > 0.95
