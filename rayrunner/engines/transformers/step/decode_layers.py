"""A decode step's decoder layers in one C call (`decode_layers.c`, built on first use by `native_build`), for a bf16
model whose every Linear is packed for the AMX tiles and whose fused operations and decode attention are built.

At a few rows the fast step's kernels take ~70% of a step; the rest is the interpreter between them, ~10 Python
and PyTorch calls per layer (figures: docs/performance.md, "The layers in one call"). That part does not split
between threads, so it also caps what a second core gives one model. This module hands the kernels' own function
pointers, the layers' packed weights and norms, and the batch's KV room to one C function that calls the same
kernels in the same order on the same buffers: the step's outputs are the Python step's to the bit. Prompts fed
beside the rows, int8 weights, LoRA, query/key norms and sliding windows keep the Python step
(`LayerDriver.for_fast` says None, or `run` None for a step whose weights are not all on the tiles).
`RAYRUNNER_DECODE_LAYERS=0` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from rayrunner.engines.transformers.kv.kv_batch import BatchCache
from rayrunner.engines.transformers.step import decode_attention, fused_ops
from rayrunner.quantization import tile_weights
from rayrunner.quantization.packed_linear import FusedPack, PackedLinear
from rayrunner.runtime import native_build

SOURCE = Path(__file__).with_suffix(".c")
SWITCH_ENV = "RAYRUNNER_DECODE_LAYERS"
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Kernels(ctypes.Structure):
    _fields_ = [("gemm", _P), ("glu", _P), ("silu_sums", _P), ("add_norm", _P), ("rope", _P), ("silu_mul", _P),
                ("attention", _P)]


class _Weight(ctypes.Structure):
    _fields_ = [("packed", _P), ("bias", _P), ("n", _I64), ("k", _I64), ("group", _I64)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("input_eps", _F), ("post_eps", _F), ("qkv", _Weight),
                ("o", _Weight), ("gate_up", _Weight), ("down", _Weight), ("keys", _P), ("values", _P),
                ("kv_row_stride", _I64), ("kv_head_stride", _I64)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("hidden_size", _I64), ("heads", _I64), ("kv_heads", _I64), ("dim", _I64),
                ("intermediate", _I64), ("length", _I64), ("scale", _F), ("threads", ctypes.c_int), ("cos", _P),
                ("sin", _P), ("bias", _P), ("final_norm", _P), ("final_eps", _F), ("hidden", _P), ("normed", _P),
                ("qkv", _P), ("rotated", _P), ("attended", _P), ("projected", _P), ("gate_up", _P),
                ("activated", _P)]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The layer driver and the kernels it calls, or None when any is missing (switched off, no AMX tiles, no
    compiler)."""
    if any(lib is None for lib in (tile_weights.library(), fused_ops.library(), decode_attention.library())):
        return None
    return native_build.load(SOURCE, SWITCH_ENV, {"decode_layers": ([_P, _P, _I64, _P], ctypes.c_int)})


@functools.cache
def _kernels() -> _Kernels:
    gemm, fused, attention = tile_weights.library(), fused_ops.library(), decode_attention.library()
    assert gemm is not None and fused is not None and attention is not None

    def address(function: Any) -> int | None:
        return ctypes.cast(function, _P).value

    return _Kernels(address(gemm.tile_gemm), address(gemm.tile_gemm_glu), fused_ops.silu_sums(),
                    address(fused.add_rms_norm), address(fused.rope), address(fused.silu_mul),
                    address(attention.decode_attention))


class LayerDriver:
    """The decoder layers of a `FastDecode`'s model, run by `decode_layers.c` (see the module docstring)."""

    def __init__(self, layers: list[Any], final_norm: Any, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int) -> None:
        self.layers, self.final_norm = layers, final_norm
        self.heads, self.kv_heads, self.dim, self.intermediate = heads, kv_heads, head_dim, intermediate
        self.hidden_size = int(final_norm.weight.shape[0])
        self.scale = float(layers[0].scaling)
        self._array = (_Layer * len(layers))()

    @classmethod
    def for_fast(cls, layers: list[Any], final_norm: Any, windows: list[int | None], heads: int, kv_heads: int,
                 head_dim: int, intermediate: int) -> LayerDriver | None:
        """A driver for the fast step's `layers` (its `_Layer`s, with `heads` query and `kv_heads` KV heads of
        `head_dim`), or None where the C step does not apply: the library not built, sliding windows, query/key
        norms, an activation other than SiLU, norms not in bf16, or SiLU's fused kernel not vectorized here."""
        if library() is None or any(window is not None for window in windows) or not layers:
            return None
        sample = torch.zeros(1, dtype=torch.bfloat16)
        if not (fused_ops.fuses_silu(sample) and decode_attention.attends(sample, heads // kv_heads, head_dim)):
            return None
        for layer in layers:
            act = type(layer.act)
            if layer.q_norm is not None or not (act is torch.nn.SiLU or act.__name__ == "SiLUActivation"):
                return None
            if any(norm.weight.dtype != torch.bfloat16 for norm in (layer.input_norm, layer.post_norm)):
                return None
        if final_norm.weight.dtype != torch.bfloat16:
            return None
        return cls(layers, final_norm, heads, kv_heads, head_dim, intermediate)

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
            batch: BatchCache) -> torch.Tensor | None:
        """The final norm's output [rows, hidden] for the decode rows' `hidden` [rows, hidden] (updated in place),
        with RoPE's `cos` and `sin` [rows, 1, head_dim] (sin's first half negated) and the attention `bias`
        [rows, 1, 1, length + 1]; each layer's keys and values appended to `batch`. None, with nothing done, when a
        weight is not on the tiles (then the Python step runs)."""
        lib = library()
        if lib is None or hidden.dtype != torch.bfloat16 or not self._weights_on_tiles():
            return None
        rows, length, heads, kv, dim = hidden.shape[0], batch.length, self.heads, self.kv_heads, self.dim
        for index, entry in enumerate(self._array):
            keys, values = batch.reserve(index)  # views of the batch's room, which holds them
            entry.keys, entry.values = keys.data_ptr(), values.data_ptr()
            entry.kv_row_stride, entry.kv_head_stride = keys.stride(0), keys.stride(1)
        empty = functools.partial(torch.empty, dtype=torch.bfloat16)
        normed, projected = empty((rows, self.hidden_size)), empty((rows, self.hidden_size))
        qkv, rotated = empty((rows, (heads + 2 * kv) * dim)), empty((rows, (heads + kv) * dim))
        attended, gate_up, activated = empty((rows, heads * dim)), empty((rows, 2 * self.intermediate)), \
            empty((rows, self.intermediate))
        cos, sin, bias = cos.contiguous(), sin.contiguous(), bias.contiguous()
        step = _Step(rows, self.hidden_size, heads, kv, dim, self.intermediate, length, self.scale,
                     torch.get_num_threads(), cos.data_ptr(), sin.data_ptr(), bias.data_ptr(),
                     self.final_norm.weight.data_ptr(), self.final_norm.variance_epsilon, hidden.data_ptr(),
                     normed.data_ptr(), qkv.data_ptr(), rotated.data_ptr(), attended.data_ptr(),
                     projected.data_ptr(), gate_up.data_ptr(), activated.data_ptr())
        status = lib.decode_layers(ctypes.byref(_kernels()), self._array, len(self.layers), ctypes.byref(step))
        if status != 0:
            raise RuntimeError(f"the decode step's layers failed (code {status})")
        for index in range(len(self.layers)):
            batch.appended(index)
        return normed

    def _weights_on_tiles(self) -> bool:
        """Refresh every layer's weights and norms in the array; False when one is not packed for the tiles (a LoRA
        adapter's peft layers, or weights unpacked for a sleep)."""
        for layer, entry in zip(self.layers, self._array, strict=True):
            weights = (_fused(layer.attention, "q_proj"), _single(layer.o_proj), _fused(layer.mlp, "gate_proj"),
                       _single(layer.down_proj))
            if any(weight is None for weight in weights):
                return False
            entry.qkv, entry.o, entry.gate_up, entry.down = weights
            entry.input_norm, entry.post_norm = layer.input_norm.weight.data_ptr(), layer.post_norm.weight.data_ptr()
            entry.input_eps, entry.post_eps = layer.input_norm.variance_epsilon, layer.post_norm.variance_epsilon
        return True


def _fused(owner: Any, first: str) -> _Weight | None:
    """The tile weight `owner`'s Linears share (q/k/v, or gate/up), from the first of them."""
    linear = getattr(owner, first, None)
    pack = linear.fused if isinstance(linear, PackedLinear) else None
    return _tile(pack.packed, pack.bias) if isinstance(pack, FusedPack) else None


def _single(linear: Any) -> _Weight | None:
    """The tile weight of a Linear packed alone."""
    if not isinstance(linear, PackedLinear) or linear.fused is not None:
        return None
    return _tile(linear.packed, linear.bias)


def _tile(packed: Any, bias: torch.Tensor | None) -> _Weight | None:
    if not isinstance(packed, tile_weights.TileWeight):
        return None
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        return None
    return _Weight(packed.data.data_ptr(), None if bias is None else bias.data_ptr(), packed.n, packed.k,
                   packed.group)
