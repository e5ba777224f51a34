"""bf16 weights packed for the CPU's AMX tiles and multiplied by rayrunner's own kernel (`tile_gemm.c`).

A decode step streams every weight from memory once for a few rows, so its matmuls go at the speed the weights are
read. oneDNN's prepacked bf16 matmul (what `packed_linear` used alone before, and what PyTorch and vLLM's CPU
backend call) reads them at ~9 GB/s a core on a Sapphire Rapids Xeon, less for small weights (each call ramps up
anew); this kernel reads a weight laid out tile by tile in the order it multiplies, fetching the weights ahead while
the tiles multiply, at 13-18 GB/s on the same core, and sums in float32 on the tiles as oneDNN does (its outputs
were the same to the bit on SmolLM2's shapes). Figures: docs/performance.md, "Matmuls on the tiles".

Layout: the weight [n, k] in groups of `group` blocks of 16 outputs (6 where n allows: the tiles left for sums), each
group's tiles block by block of 32 inputs, a tile holding 16 input pairs of 16 outputs (the pairs AMX's bf16
multiply takes). A plain tensor: it can be unpacked (`dense`) for a sleep or for peft. Prompts' many rows go through
the same kernel 32 rows at a time, the group's weights then in cache. A gate and an up projection packed side by side
can be multiplied and combined in one pass (`glu`: SiLU times up from the float32 sums, neither written).

On CPUs without AMX, without a C compiler, or with `RAYRUNNER_TILE_GEMM=0`, `library()` is None and weights are
packed for oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from rayrunner.quantization.cpu_gemm import amx_tiles
from rayrunner.runtime import native_build

SOURCE = Path(__file__).with_name("tile_gemm.c")
SWITCH_ENV = "RAYRUNNER_TILE_GEMM"
MAX_GROUP = 6  # blocks of 16 outputs a pass sums at once (eight tiles: one for the rows, one for the weight)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The tile kernel, built if needed and loaded; None when switched off, on CPUs without AMX tiles, or not
    buildable here."""
    if not amx_tiles():
        return None
    pointer, i64 = native_build.POINTER, native_build.I64
    lib = native_build.load(SOURCE, SWITCH_ENV, {
        "tiles_ready": ([], ctypes.c_int),
        "tile_gemm": ([pointer, i64, i64, i64, pointer, i64, i64, pointer, pointer, i64, ctypes.c_int], ctypes.c_int),
        "tile_gemm_glu": ([pointer, i64, i64, i64, pointer, i64, i64, pointer, pointer, i64, ctypes.c_int],
                          ctypes.c_int)})
    return lib if lib is not None and lib.tiles_ready() else None


def packs(weight: torch.Tensor) -> bool:
    """Whether `weight` [n, k] can be packed for the tiles: bf16 on the CPU, n a multiple of 16 and k of 32, with the
    kernel built."""
    return (weight.dim() == 2 and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0 and library() is not None)


class TileWeight:
    """A weight [n, k] packed for the tiles (see the module docstring); `multiply` is `F.linear` with it."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not packs(weight):
            raise ValueError(f"a weight {tuple(weight.shape)} {weight.dtype} on {weight.device} cannot be packed "
                             "for the tiles")
        self.n, self.k = weight.shape
        blocks = self.n // 16
        self.group = next(size for size in range(MAX_GROUP, 0, -1) if blocks % size == 0)
        tiles = weight.detach().reshape(blocks // self.group, self.group, 16, self.k // 32, 16, 2)
        # (groups, blocks of 32 inputs, blocks of 16 outputs in the group, input pairs, outputs, pair)
        self.data = tiles.permute(0, 3, 1, 4, 2, 5).contiguous().view(-1)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def multiply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x` [..., k] times the weight transposed, plus `bias` [n] unless None: [..., n] in bf16."""
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.k:
            raise ValueError(f"input {tuple(x.shape)} {x.dtype} for a bf16 weight of {self.k} inputs")
        rows = x.reshape(-1, self.k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.n), dtype=torch.bfloat16)
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
            bias = bias.to(torch.bfloat16).contiguous()
        lib = library()
        assert lib is not None  # packed only where it was built
        if rows.shape[0] and lib.tile_gemm(rows.data_ptr(), rows.stride(0), rows.shape[0], self.k,
                                           self.data.data_ptr(), self.n, self.group,
                                           None if bias is None else bias.data_ptr(), out.data_ptr(), self.n,
                                           torch.get_num_threads()) != 0:
            raise RuntimeError(f"the tile kernel refused a [{rows.shape[0]}, {self.k}] x [{self.n}, {self.k}] matmul")
        return out.view(*x.shape[:-1], self.n)

    @property
    def halves(self) -> bool:
        """Whether the weight's two halves of outputs (a gate and an up projection side by side) can be multiplied
        and combined by `glu`: each half whole groups."""
        return (self.n // 2) % (16 * self.group) == 0

    def glu(self, x: torch.Tensor, combiner: int) -> torch.Tensor:
        """`x` [..., k] times the weight's first and second half of outputs, combined by the C function at
        `combiner` (`fused_ops.silu_sums`) from the tiles' float32 sums without writing either: [..., n / 2] in bf16.
        Needs `halves`."""
        if x.dtype != torch.bfloat16 or x.shape[-1] != self.k or not self.halves:
            raise ValueError(f"input {tuple(x.shape)} {x.dtype} for the halves of a bf16 weight {self.n} x {self.k}")
        rows = x.reshape(-1, self.k)
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        out = torch.empty((rows.shape[0], self.n // 2), dtype=torch.bfloat16)
        lib = library()
        assert lib is not None  # packed only where it was built
        if rows.shape[0] and lib.tile_gemm_glu(rows.data_ptr(), rows.stride(0), rows.shape[0], self.k,
                                               self.data.data_ptr(), self.n, self.group, combiner, out.data_ptr(),
                                               self.n // 2, torch.get_num_threads()) != 0:
            raise RuntimeError(f"the tile kernel refused the halves of a [{rows.shape[0]}, {self.k}] x "
                               f"[{self.n}, {self.k}] matmul")
        return out.view(*x.shape[:-1], self.n // 2)

    def dense(self) -> torch.Tensor:
        """The weight [n, k] unpacked (a new tensor)."""
        tiles = self.data.view(self.n // 16 // self.group, self.k // 32, self.group, 16, 16, 2)
        return tiles.permute(0, 2, 4, 1, 3, 5).reshape(self.n, self.k)
