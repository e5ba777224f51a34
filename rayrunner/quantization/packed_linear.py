"""bf16 Linears whose weights are prepacked once, on CPUs with a native bf16 GEMM (AVX-512 BF16, AMX): for
rayrunner's own kernel on AMX tiles where it is built (`tile_weights`), else for oneDNN.

PyTorch's `F.linear` on a plain bf16 weight lets oneDNN (or its own kernel) read the weight in its stored layout on
every call; reordered once into the blocked layout oneDNN's kernels want (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor does when it freezes weights, and what vLLM's CPU backend does with its own oneDNN handle), each call
skips that work. Figures are in docs/performance.md ("A 16-row decode step, profiled"); the gain is largest for the
few rows of a decode step and nil for a prompt's hundreds.

A weight packed for oneDNN is an opaque tensor: no storage to map, save or view. So it replaces the plain weight only
while the model serves; `unpack_linears` gives every packed Linear its plain weight back (before a sleep parks the
weights, and before peft wraps Linears with LoRA adapters), `pack_linears` packs them (at load, and after a wake;
`ParkedWeights` does both).
A Linear whose weight another module shares (an lm head tied to the input embedding) keeps the plain weight beside
the packed one: the embedding looks rows up in it.

Linears of one module that read the same input (an attention's `q_proj`/`k_proj`/`v_proj`, an MLP's
`gate_proj`/`up_proj`) share one packed weight, their rows side by side (`FusedPack`): the decode step makes one call
where it made three or two, and transformers' forward, which calls each Linear on the same tensor in turn, gets the
first call's output sliced for the others.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from rayrunner.quantization.cpu_gemm import native_half_gemm, plain_cpu_weight
from rayrunner.quantization.tile_weights import TileWeight, packs

BATCH_HINT = 16  # rows oneDNN chooses the packed layout for: a decode step's batch (any row count works)
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # Linears of one module reading one input


@functools.cache
def packing_pays() -> bool:
    """Whether this CPU runs bf16 matmuls with oneDNN's native kernels, where prepacked weights pay."""
    try:
        return native_half_gemm(torch.bfloat16) and bool(torch.backends.mkldnn.is_available())
    except (AttributeError, RuntimeError):
        return False


class OneDnnWeight:
    """A weight [n, k] reordered once for oneDNN's bf16 matmul (an opaque tensor); `multiply` is `F.linear` with
    it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.n, self.k = weight.shape
        self.data = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.data, bias, "none", [], "")

    def dense(self) -> torch.Tensor:
        return self.data.to_dense().reshape(self.n, self.k)


PackedWeight = TileWeight | OneDnnWeight


class FusedPack:
    """One packed weight for Linears that read the same input, their output rows side by side (`project`).
    `output_of` serves them one at a time as transformers' forward calls them: the first call on an input projects
    it for all, the others get their slice of that output, which is dropped once each has had its own."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        weights = [linear.weight.detach() for linear in linears]
        with torch.inference_mode(False):
            self.packed = _pack(torch.cat(weights))
            self.bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
        ends = list(itertools.accumulate(weight.shape[0] for weight in weights))
        self.bounds = list(zip([0, *ends[:-1]], ends, strict=True))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._pending: set[int] = set()

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """All the Linears' outputs on `x`, side by side."""
        return self.packed.multiply(x, self.bias)

    def output_of(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Linear `index`'s output on `x` (the same tensor object for all of them: an input changed in place between
        the calls would not be seen, which transformers' attention and MLP never do)."""
        if self._input is not x or index not in self._pending:
            self._input, self._output, self._pending = x, self.project(x), set(range(len(self.bounds)))
        output = self._output
        assert output is not None
        self._pending.discard(index)
        if not self._pending:
            self._input = self._output = None
        start, end = self.bounds[index]
        return output[..., start:end]

    def weight_of(self, index: int) -> torch.Tensor:
        """Linear `index`'s plain weight, unpacked (a tensor of its own)."""
        start, end = self.bounds[index]
        with torch.inference_mode(False):
            return self._dense[start:end].clone()

    @functools.cached_property
    def _dense(self) -> torch.Tensor:
        """The shared weight unpacked, once for all its Linears (it goes with this pack once they all unpacked)."""
        return self.packed.dense()


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies with its weight prepacked for oneDNN while `packed` (or `fused`, a weight it
    shares with its siblings) is set (see the module docstring); `weight` is then None unless another module shares
    it."""

    packed: PackedWeight | None = None
    fused: FusedPack | None = None
    fused_index = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.output_of(self.fused_index, x)
        packed = self.packed
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        return packed.multiply(x, self.bias)

    @property
    def is_packed(self) -> bool:
        return self.packed is not None or self.fused is not None

    def pack(self, shared: bool) -> None:
        """Pack the plain weight; drop it unless `shared` (another module reads it)."""
        with torch.inference_mode(False):
            self.packed = _pack(self.weight.detach())
        if not shared:
            self._parameters["weight"] = None

    def join(self, fused: FusedPack, index: int) -> None:
        """Multiply with row block `index` of `fused` from now on; the plain weight goes."""
        self.fused, self.fused_index = fused, index
        self._parameters["weight"] = None

    def unpack(self) -> None:
        """Give the Linear its plain weight back (from the packed one unless it kept it) and drop the packed."""
        if self.fused is not None:
            self._parameters["weight"] = nn.Parameter(self.fused.weight_of(self.fused_index), requires_grad=False)
            self.fused = None
        if self.packed is None:
            return
        if self._parameters.get("weight") is None:
            with torch.inference_mode(False):
                plain = self.packed.dense()
            self._parameters["weight"] = nn.Parameter(plain, requires_grad=False)
        self.packed = None


def fused_pack(owner: nn.Module, names: tuple[str, ...]) -> FusedPack | None:
    """The packed weight `owner`'s Linears `names` share, if they do."""
    first = getattr(owner, names[0], None)
    return first.fused if isinstance(first, PackedLinear) else None


def pack_linears(model: nn.Module) -> int:
    """Pack every plain bf16 CPU `nn.Linear` of `model` (and every `PackedLinear` unpacked since) where packing
    pays, siblings reading one input into one shared weight (`FUSED`); the number packed. Quantized Linears (another
    class, or a tensor subclass as weight) and the base layers of peft's LoRA layers (peft reads their weights) stay
    as they are."""
    if not packing_pays():
        return 0
    shared = _shared_weights(model)
    wrapped = {id(module.base_layer) for module in model.modules() if isinstance(getattr(module, "base_layer", None),
                                                                                  nn.Module)}

    def packable(module: Any) -> bool:
        unpacked = type(module) is nn.Linear or (type(module) is PackedLinear and not module.is_packed)
        return unpacked and id(module) not in wrapped and _plain_bf16_cpu(module.weight)

    packed = 0
    for owner in list(model.modules()):
        for names in FUSED:
            linears: list[Any] = [getattr(owner, name, None) for name in names]
            if all(packable(linear) and id(linear.weight) not in shared for linear in linears) and _fusable(linears):
                _fuse(linears)
                packed += len(linears)
    for module in model.modules():
        if packable(module):
            module.__class__ = PackedLinear
            cast(PackedLinear, module).pack(shared=id(module.weight) in shared)
            packed += 1
    return packed


def _fuse(linears: list[nn.Linear]) -> None:
    """Make `linears` `PackedLinear`s sharing one packed weight."""
    fused = FusedPack(linears)
    for index, linear in enumerate(linears):
        linear.__class__ = PackedLinear
        cast(PackedLinear, linear).join(fused, index)


def unpack_linears(model: nn.Module) -> int:
    """Give every `PackedLinear` of `model` its plain weight back; the number unpacked."""
    linears = list(_packed_linears(model))
    for linear in linears:
        linear.unpack()
    return len(linears)


def packed_bytes(model: nn.Module) -> int:
    """Bytes held by the packed weights of `model` (not counted by its state dict), a shared one counted once."""
    weights = {id(weight): weight for linear in _packed_linears(model)
               for weight in (linear.packed, None if linear.fused is None else linear.fused.packed)
               if weight is not None}
    return sum(weight.nbytes for weight in weights.values())


def _packed_linears(model: nn.Module) -> Iterator[PackedLinear]:
    return (module for module in model.modules() if isinstance(module, PackedLinear) and module.is_packed)


def _fusable(linears: list[Any]) -> bool:
    """Linears that can share one weight: the same input width, all with a bias or none."""
    return (len({linear.in_features for linear in linears}) == 1
            and len({linear.bias is None for linear in linears}) == 1)


def _pack(weight: torch.Tensor) -> PackedWeight:
    """`weight` packed for the tiles where it can be (`tile_weights`), else for oneDNN."""
    return TileWeight(weight) if packs(weight) else OneDnnWeight(weight)


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
