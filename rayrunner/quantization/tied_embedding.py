"""Int8 for a tied input embedding / lm_head pair, kept as one shared copy.

In small models the tied embedding is a large share of the weights (22% of SmolLM2-135M), so leaving it in bf16
caps what ISQ can save. torchao has no good answer for it on CPU: quantizing the lm_head as a Linear unties it (a
second copy), and torchao's `embedding` on its int8 tensor dequantizes the whole table on every lookup (~120 ms for
SmolLM2's 49k x 576 table). Here one int8 table serves both roles, quantized like GGUF's Q8_0 (symmetric, blocks of
32 along each row, one scale per block): a lookup gathers and scales only the rows it needs, and the projection sums
one PyTorch int8-weight matmul per block (`aten._weight_int8pack_mm`) in float32 and returns float32 logits
(rounding them to bf16 would turn near-ties between tokens into exact ties).

CPU only: that kernel is CPU's, and on CUDA the alternative (dequantizing the table at every step) was not measured
here, so on CUDA the pair stays in the model's dtype. So does a pair whose rows do not split into blocks of 32: the
kernel needs rows in multiples of 16 (on this CPU, 24 or 40 gave garbage and 33 crashed), and GGUF's blocks are 32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

INT8_MAX = 127
BLOCK = 32  # GGUF's Q8_0 block
ROWS_PER_CHUNK = 4096  # quantize this many rows at a time, so no float32 copy of the whole table is ever made


class Int8Table(nn.Module):
    """A [rows, dim] weight as int8 in blocks along dim, stored block-major: qdata [blocks, rows, block] and one
    scale per block, scale [blocks, rows], in the original dtype."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.qdata: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Table:
        """Quantize `weight` block by block (absmax / 127), a chunk of rows at a time, without changing it."""
        rows, dim = weight.shape
        why = _blocks_misfit(dim)
        if why is not None:
            raise ValueError(why)
        qdata = torch.empty(dim // BLOCK, rows, BLOCK, dtype=torch.int8, device=weight.device)
        scale = torch.empty(dim // BLOCK, rows, dtype=weight.dtype, device=weight.device)
        for start in range(0, rows, ROWS_PER_CHUNK):
            chunk = slice(start, start + ROWS_PER_CHUNK)
            blocks = weight[chunk].detach().float().view(-1, dim // BLOCK, BLOCK).transpose(0, 1)
            chunk_scale = blocks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX
            qdata[:, chunk] = torch.round(blocks / chunk_scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
            scale[:, chunk] = chunk_scale.to(weight.dtype)
        return cls(qdata, scale)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (an embedding lookup)."""
        blocks = self.qdata[:, ids].to(self.scale.dtype) * self.scale[:, ids].unsqueeze(-1)
        return blocks.movedim(0, -2).flatten(-2)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden @ table.T` (the lm_head) in float32, without materialising the dequantized table."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        parts = flat.view(flat.shape[0], *self.qdata.shape[::2]).unbind(1)
        total = torch.zeros(flat.shape[0], self.qdata.shape[1], dtype=torch.float32, device=flat.device)
        for part, qdata, scale in zip(parts, self.qdata, self.scale, strict=True):
            total += torch.ops.aten._weight_int8pack_mm(part.contiguous(), qdata, scale.to(flat.dtype))
        return total.reshape(*hidden.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        """The whole [rows, dim] table in the original dtype."""
        blocks = self.qdata.to(self.scale.dtype) * self.scale.unsqueeze(-1)
        return blocks.transpose(0, 1).flatten(1)


class Int8Embedding(nn.Module):
    """An embedding lookup served from a shared `Int8Table`."""

    def __init__(self, table: Int8Table) -> None:
        super().__init__()
        self.table = table

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids)


class Int8LMHead(nn.Module):
    """An output projection (no bias) served from a shared `Int8Table`."""

    def __init__(self, table: Int8Table) -> None:
        super().__init__()
        self.table = table

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table.project(hidden)


def quantize_tied_embedding(model: Any) -> bool:
    """Replace a CPU `model`'s tied embedding and lm_head by int8 modules sharing one table; False if they are not
    a plain tied pair the table can hold."""
    pair = _tied_pair(model)
    if pair is None or _misfit(pair[1]) is not None:
        return False
    table = Int8Table.from_weight(pair[1].weight)
    model.set_input_embeddings(Int8Embedding(table))
    model.set_output_embeddings(Int8LMHead(table))
    return True


def tied_head_misfit(model: Any) -> tuple[nn.Linear, str] | None:
    """A plain tied lm_head that the int8 table cannot hold, and why; None when there is none."""
    pair = _tied_pair(model)
    if pair is None:
        return None
    why = _misfit(pair[1])
    return None if why is None else (pair[1], why)


def _misfit(head: nn.Linear) -> str | None:
    if head.weight.device.type != "cpu":
        return "the shared int8 table is CPU-only"
    return _blocks_misfit(head.in_features)


def _blocks_misfit(dim: int) -> str | None:
    return None if dim % BLOCK == 0 else f"rows of {dim} do not split into int8 blocks of {BLOCK}"


def _tied_pair(model: Any) -> tuple[nn.Embedding, nn.Linear] | None:
    get_input = getattr(model, "get_input_embeddings", None)
    get_output = getattr(model, "get_output_embeddings", None)
    if get_input is None or get_output is None:
        return None
    embedding, head = get_input(), get_output()
    plain = (
        type(embedding) is nn.Embedding  # exactly: subclasses (Gemma's scaled embedding) change the lookup
        and type(head) is nn.Linear
        and head.bias is None
        and type(head.weight.data) is torch.Tensor
        and head.weight.is_floating_point()
        and head.weight.untyped_storage().data_ptr() == embedding.weight.untyped_storage().data_ptr()
    )
    return (embedding, head) if plain else None
