"""Int8 weights with one scale per output row, and a CPU matmul that reads them without a full-size float copy.

Layout: `qdata` [out, in] int8, symmetric (absmax / 127 per row, rounded against the stored scale), `scale` [out]
in the model's dtype. `int8_matmul` picks its kernel by the rows it multiplies. Measured on SmolLM2's shapes on a
2-core AVX-512 CPU, weights streamed from memory (30 layers' Linears, bf16 activations):
- few rows: PyTorch's int8-weight kernel `aten._weight_int8pack_mm` reads each weight byte once and scales float32
  sums: 9 ms at batch 1 against 18 ms in bf16. Its cost grows with every row (34 ms against 26 ms at 16 rows).
  On CPUs with AVX-512 BF16, rayrunner's own kernel (`int8_rows.c`) takes its place: the same float32 sums of the
  same products, the weights fetched a few blocks ahead, which PyTorch's leaves to the hardware, and widened once for
  all rows: 0.72-0.75x its time from 1 to 16 rows on a Sapphire Rapids Xeon (docs/performance.md, "Q8_0 on AVX-512").
- more rows: the weight is converted to the activation dtype `CONVERT_ROWS` output rows at a time and multiplied by
  that dtype's GEMM, the scales applied to the output: 28 ms at 16 rows, within ~5% of bf16 from 8 to 128 rows.
The crossover is set in the engine, where the step scheduler's thread pays more for each parallel op: at 16
sequences it decoded at 0.91-0.99x bf16's speed with the kernel against 0.68x converting (raw forward passes in the
main thread: 0.89-0.93x against 0.85x). A vocabulary-sized head converts cheaply per row for its size and switches
after 8 rows (16 rows: 7.4 ms against 12.3 ms in the kernel and 6.4 ms in bf16). The kernel needs in_features in
multiples of 16 (other widths gave garbage or crashed) and is only fast on bf16 inputs (on fp16 and float32
converting is faster); other cases take the conversion path, which holds any shape. On CPUs without a native bf16
GEMM (AVX2 only) the conversion path converts to float32 instead (`cpu_gemm`: 3.5-4x faster there).

Why rows and not GGUF's blocks of 32: with one scale per row a dot product is one kernel call; blocks need one call
per block (18 for SmolLM2's 576 inputs) or a dequantized copy per call, which is what torchao does (about half of
bf16's decode speed). The price is perplexity: +0.85% on SmolLM2 against +0.47% for blocks (+0.58% with the
weights moved off their Q4_1 grid), within the Q8_0 target of +1% (`bench/bench_quantization.py`).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from rayrunner.quantization.cpu_gemm import wide_dtype
from rayrunner.runtime import native_build

INT8_MAX = 127
KERNEL_MAX_ROWS = 16  # up to this many rows take the int8 kernel (see the module docstring)
CONVERT_ROWS = 4096  # output rows converted at a time on the conversion path (~4.7 MB of bf16 at 576 inputs)
KERNEL_MAX_ROWS_LARGE = 8  # the same for weights of more than CONVERT_ROWS output rows (a vocabulary-sized head)
KERNEL_IN_MULTIPLE = 16
OWN_OUT_MULTIPLE, OWN_IN_MULTIPLE = 4, 32  # what `int8_rows.c` takes: outputs in blocks of 4, inputs of 32
SOURCE = Path(__file__).with_suffix(".c")
SWITCH_ENV = "RAYRUNNER_INT8_GEMM"
ROWS_PER_CHUNK = 4096  # quantize this many rows at a time, so no float32 copy of a whole table is ever made


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as int8 qdata [out, in] and one scale per row [out] in its dtype, without changing it."""
    qdata = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=weight.dtype, device=weight.device)
    for start in range(0, weight.shape[0], ROWS_PER_CHUNK):
        chunk = weight[start:start + ROWS_PER_CHUNK].detach().float()
        rounded = (chunk.abs().amax(dim=1) / INT8_MAX).to(weight.dtype)
        rounded = rounded.masked_fill(rounded == 0, 1)  # an all-zero row
        qdata[start:start + ROWS_PER_CHUNK] = torch.round(chunk / rounded.float()[:, None]).clamp(-INT8_MAX, INT8_MAX)
        scale[start:start + ROWS_PER_CHUNK] = rounded
    return qdata, scale


def int8_matmul(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x @ (qdata * scale[:, None]).T` in x's dtype, over x's last dimension (see the module docstring)."""
    flat = x.reshape(-1, x.shape[-1])
    scale = scale.to(x.dtype)
    most = KERNEL_MAX_ROWS if qdata.shape[0] <= CONVERT_ROWS else KERNEL_MAX_ROWS_LARGE
    if flat.shape[0] <= most and x.dtype == torch.bfloat16 and qdata.shape[1] % KERNEL_IN_MULTIPLE == 0:
        out = few_rows_kernel(flat, qdata, scale)
    else:
        dtype = wide_dtype(x.dtype)  # float32 where this CPU has no native bf16 GEMM (`cpu_gemm`)
        flat = flat.to(dtype)
        parts = [F.linear(flat, part.to(dtype)) for part in qdata.split(CONVERT_ROWS)]
        out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).mul_(scale.to(dtype)).to(x.dtype)
    return out.reshape(*x.shape[:-1], qdata.shape[0])


@functools.cache
def library() -> ctypes.CDLL | None:
    """rayrunner's int8 kernel (`int8_rows.c`), built if needed and loaded; None when switched off, on CPUs without
    AVX-512 BF16, or not buildable here."""
    pointer, i64 = native_build.POINTER, native_build.I64
    lib = native_build.load(SOURCE, SWITCH_ENV, {
        "int8_rows_ready": ([], ctypes.c_int),
        "int8_rows_gemm": ([pointer, i64, i64, i64, pointer, i64, pointer, pointer, i64, ctypes.c_int], ctypes.c_int)})
    return lib if lib is not None and lib.int8_rows_ready() else None


def few_rows_kernel(rows: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`rows` [m, k] bf16 (k a multiple of KERNEL_IN_MULTIPLE) times `qdata` [n, k] scaled by `scale` [n]:
    rayrunner's kernel (`int8_rows.c`) where it takes the weight, else PyTorch's `_weight_int8pack_mm`."""
    scale = scale.to(torch.bfloat16)
    if _own_kernel_takes(qdata):
        return _own_kernel(rows, qdata, scale)
    return torch.ops.aten._weight_int8pack_mm(rows.contiguous(), qdata, scale)


def _own_kernel_takes(qdata: torch.Tensor) -> bool:
    return (qdata.shape[0] % OWN_OUT_MULTIPLE == 0 and qdata.shape[1] % OWN_IN_MULTIPLE == 0
            and qdata.is_contiguous() and qdata.device.type == "cpu" and library() is not None)


def _own_kernel(rows: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`rows` [m, k] bf16 times int8 `qdata` [n, k] with bf16 `scale` [n], by `int8_rows.c`."""
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    scale = scale.contiguous()
    out = torch.empty((rows.shape[0], qdata.shape[0]), dtype=torch.bfloat16)
    lib = library()
    assert lib is not None  # taken only where it was built
    if lib.int8_rows_gemm(rows.data_ptr(), rows.stride(0), rows.shape[0], qdata.shape[1], qdata.data_ptr(),
                          qdata.shape[0], scale.data_ptr(), out.data_ptr(), out.stride(0),
                          torch.get_num_threads()) != 0:
        raise RuntimeError(f"the int8 kernel refused a {tuple(rows.shape)} x {tuple(qdata.shape)} matmul")
    return out


def dequantize_rows(qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return qdata.to(scale.dtype) * scale[:, None]


class Int8Linear(nn.Module):
    """A Linear whose weight is int8 with one scale per output row (CPU; see the module docstring)."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.qdata: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*quantize_rows(linear.weight), linear.bias)

    @property
    def in_features(self) -> int:
        return int(self.qdata.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.qdata.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = int8_matmul(x, self.qdata, self.scale)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def share_storage(linears: list[Int8Linear]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Concatenate the weights of Linears that read the same input (a layer's q/k/v, gate/up) into one qdata and one
    scale, which each Linear then holds a view of: one kernel call computes them all, with no second copy in memory.
    None (and nothing changed) when they cannot share: a bias, different widths or dtypes, or already views."""
    first = linears[0]
    if any(linear.bias is not None or linear.qdata.shape[1] != first.qdata.shape[1]
           or linear.scale.dtype != first.scale.dtype or linear.qdata._base is not None for linear in linears):
        return None
    qdata = torch.cat([linear.qdata for linear in linears])
    scale = torch.cat([linear.scale for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.out_features
        linear.qdata, linear.scale = qdata[start:start + rows], scale[start:start + rows]
        start += rows
    return qdata, scale

