"""Int8 for a tied input embedding / lm_head pair, kept as one shared copy.

In small models the tied embedding is a large share of the weights (22% of SmolLM2-135M), so leaving it in bf16
caps what ISQ can save. torchao has no good answer for it on CPU: quantizing the lm_head as a Linear unties it (a
second copy), and torchao's `embedding` on its int8 tensor dequantizes the whole table on every lookup (~120 ms for
SmolLM2's 49k x 576 table). Here one int8 table, one scale per row (`int8_rows`), serves both roles: a lookup
gathers and scales only the rows it needs, and the projection is `int8_matmul`, so its logits come out in the
hidden states' dtype like an unquantized head's. On SmolLM2 the projection takes 1.8 ms at batch 1, 7.4 ms at 16
rows and 10 ms at 32 (bf16: 4.0, 6.4 and 8.7 ms). The blocks of 32 it replaces took one int8 kernel call per block:
2.3 ms at batch 1, 21 ms at 16 rows, 360 ms at 32 and 190 ms at batch 1 on float32 hidden states.

CPU only: on CUDA the pair stays in the model's dtype (dequantizing the table at every step was not measured there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rayrunner.quantization.int8_rows import dequantize_rows, int8_matmul, quantize_rows


class Int8Table(nn.Module):
    """A [rows, dim] weight as int8 with one scale per row: qdata [rows, dim], scale [rows] in the original dtype."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.qdata: torch.Tensor
        self.scale: torch.Tensor
        self.register_buffer("qdata", qdata)
        self.register_buffer("scale", scale)

    @classmethod
    def from_weight(cls, weight: torch.Tensor) -> Int8Table:
        return cls(*quantize_rows(weight))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (an embedding lookup)."""
        return self.qdata[ids].to(self.scale.dtype) * self.scale[ids].unsqueeze(-1)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """`hidden @ table.T` (the lm_head), without materialising the dequantized table."""
        return int8_matmul(hidden, self.qdata, self.scale)

    def dequantize(self) -> torch.Tensor:
        """The whole [rows, dim] table in the original dtype."""
        return dequantize_rows(self.qdata, self.scale)


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
    return None if head.weight.device.type == "cpu" else "the shared int8 table is CPU-only"


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
