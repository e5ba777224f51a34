"""bf16 Linears whose weights are prepacked once for oneDNN, on CPUs with a native bf16 GEMM (AVX-512 BF16, AMX).

PyTorch's `F.linear` on a plain bf16 weight lets oneDNN (or its own kernel) read the weight in its stored layout on
every call; reordered once into the blocked layout oneDNN's kernels want (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor does when it freezes weights, and what vLLM's CPU backend does with its own oneDNN handle), each call
skips that work. Figures are in docs/performance.md ("A 16-row decode step, profiled"); the gain is largest for the
few rows of a decode step and nil for a prompt's hundreds.

The packed weight is an opaque oneDNN tensor: no storage to map, save or view. So it replaces the plain weight only
while the model serves; `unpack_linears` gives every packed Linear its plain weight back (before a sleep parks the
weights, and before peft wraps Linears with LoRA adapters), `pack_linears` packs them (at load, and after a wake;
`ParkedWeights` does both).
A Linear whose weight another module shares (an lm head tied to the input embedding) keeps the plain weight beside
the packed one: the embedding looks rows up in it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from rayrunner.quantization.cpu_gemm import native_half_gemm, plain_cpu_weight

BATCH_HINT = 16  # rows oneDNN chooses the packed layout for: a decode step's batch (any row count works)


@functools.cache
def packing_pays() -> bool:
    """Whether this CPU runs bf16 matmuls with oneDNN's native kernels, where prepacked weights pay."""
    try:
        return native_half_gemm(torch.bfloat16) and bool(torch.backends.mkldnn.is_available())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with its weight prepacked for oneDNN while `packed` is set (see the module
    docstring); `weight` is then None unless another module shares it."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def pack(self, shared: bool) -> None:
        """Pack the plain weight; drop it unless `shared` (another module reads it)."""
        weight = self.weight
        with torch.inference_mode(False):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        if not shared:
            self._parameters["weight"] = None

    def unpack(self) -> None:
        """Give the Linear its plain weight back (from the packed one unless it kept it) and drop the packed."""
        if self.packed is None:
            return
        if self._parameters.get("weight") is None:
            with torch.inference_mode(False):
                plain = self.packed.to_dense().reshape(self.out_features, self.in_features)
            self._parameters["weight"] = nn.Parameter(plain, requires_grad=False)
        self.packed = None


def pack_linears(model: nn.Module) -> int:
    """Pack every plain bf16 CPU `nn.Linear` of `model` (and every `PackedLinear` unpacked since) where packing
    pays; the number packed. Quantized Linears (another class, or a tensor subclass as weight) and the base layers
    of peft's LoRA layers (peft reads their weights) stay as they are."""
    if not packing_pays():
        return 0
    shared = _shared_weights(model)
    wrapped = {id(module.base_layer) for module in model.modules() if isinstance(getattr(module, "base_layer", None),
                                                                                  nn.Module)}
    packed = 0
    for module in model.modules():
        unpacked = type(module) is nn.Linear or (type(module) is PackedLinear and module.packed is None)
        if unpacked and id(module) not in wrapped and _plain_bf16_cpu(module.weight):
            module.__class__ = PackedLinear
            cast(PackedLinear, module).pack(shared=id(module.weight) in shared)
            packed += 1
    return packed


def unpack_linears(model: nn.Module) -> int:
    """Give every `PackedLinear` of `model` its plain weight back; the number unpacked."""
    linears = list(_packed_linears(model))
    for linear in linears:
        linear.unpack()
    return len(linears)


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by the packed weights of `model` (not counted by its state dict)."""
    return sum(linear.packed.numel() * linear.packed.element_size() for linear in _packed_linears(model)
               if linear.packed is not None)


def _packed_linears(model: nn.Module) -> Iterator[PackedLinear]:
    return (module for module in model.modules() if isinstance(module, PackedLinear) and module.packed is not None)


def _shared_weights(model: nn.Module) -> set[int]:
    """Ids of the parameters that more than one module holds (tied weights)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None:
                seen[id(parameter)] = seen.get(id(parameter), 0) + 1
    return {key for key, count in seen.items() if count > 1}


def _plain_bf16_cpu(weight: Any) -> bool:
    return plain_cpu_weight(weight) and weight.dtype == torch.bfloat16
