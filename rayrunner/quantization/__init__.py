"""In-situ quantization (ISQ): mistral.rs level names mapped onto weight-only formats (torchao, CPU int8 rows).

`parse_isq` is torch-free (spec validation uses it); `quantize_model` and `weight_bytes` import torch and torchao
only when called. The name-to-format table lives in `torchao_backend`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rayrunner.quantization.gptq import is_gptq_config, require_gptq
from rayrunner.quantization.names import VALID_NAMES, IsqLevel, parse_isq

if TYPE_CHECKING:
    import torch

__all__ = ["VALID_NAMES", "IsqLevel", "is_gptq_config", "parse_isq", "quantize_model", "require_gptq",
           "weight_bytes"]


def quantize_model(model: torch.nn.Module, isq: str, device: str) -> dict[str, Any]:
    """Quantize `model` in place to ISQ level `isq` on `device` ("cpu", "cuda", "cuda:N"); return a JSON report:
    requested, applied, exact (False when a nearest substitute was used), quantized_layers (a count),
    fallback_layers (name -> {applied, reason}: Linears the level's format cannot hold, in the next one that fits),
    skipped_layers (name -> reason: Linears left in the model's dtype), tied_embedding_int8, weight_bytes."""
    from rayrunner.quantization.torchao_backend import quantize_model as quantize

    return quantize(model, isq, device)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes held by the model's weights, each storage counted once (tied and quantized weights measured right)."""
    from rayrunner.quantization.weights import weight_bytes as measure

    return measure(model)
