"""The data-only tensor file (`weights.save_tensors` / `load_tensors`): views, tied and quantized tensors come back as
they were, mapped or read; entries that reach outside their storage or name other classes are refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from torch import nn

from rayrunner.quantization.int8_rows import Int8Linear, share_storage
from rayrunner.quantization.names import parse_isq
from rayrunner.quantization.torchao_backend import plans_for
from rayrunner.quantization.weights import ALIGN, load_tensors, save_tensors


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("copy", [False, True])
def test_views_tied_tensors_and_parameters_come_back_as_they_were(tmp_path: Path, copy: bool) -> None:
    linears = [Int8Linear.from_linear(nn.Linear(32, rows, bias=False).to(torch.bfloat16)) for rows in (8, 4)]
    base, _ = share_storage(linears)  # type: ignore[misc]  (views of one int8 tensor, as fast decode makes)
    weight = nn.Parameter(torch.randn(3, 5), requires_grad=False)
    grad = nn.Parameter(torch.randn(2))
    odd = torch.arange(7, dtype=torch.int8)  # a size that is no multiple of the alignment
    tensors = [base, linears[0].qdata, linears[1].qdata, weight, weight, None, grad, weight.t(), odd]
    save_tensors(tmp_path / "t.safetensors", tensors, {"note": [1, "two"]})
    back, metadata = load_tensors(tmp_path / "t.safetensors", copy=copy)
    assert metadata == {"note": [1, "two"]}
    assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(back, tensors, strict=True))
    assert _storage(back[1]) == _storage(back[2]) == _storage(back[0]) and back[1]._base is None  # one storage
    assert back[4] is back[3] and isinstance(back[3], nn.Parameter) and not back[3].requires_grad
    assert isinstance(back[6], nn.Parameter) and back[6].requires_grad
    assert back[7].stride() == (1, 5) and _storage(back[7]) == _storage(back[3])
    assert all(t.data_ptr() % ALIGN == 0 for t in (back[0], back[3], back[6], back[8]))
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as file:  # a plain safetensors file
        assert len(list(file.keys())) == 4


def test_torchao_tensors_come_back_flattened_and_rebuilt(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(64, 32, bias=False).to(torch.bfloat16))
    plans_for(parse_isq("Q4K"), "cpu")[0].apply(model, ["0"])
    weight = model[0].weight
    save_tensors(tmp_path / "int4.safetensors", [weight], None)
    [back], _ = load_tensors(tmp_path / "int4.safetensors")
    assert type(back) is type(weight) and isinstance(back, nn.Parameter) and back.block_size == weight.block_size
    assert torch.equal(back.qdata, weight.qdata) and torch.equal(back.scale_and_zero, weight.scale_and_zero)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(nn.functional.linear(x, back), model(x))


@pytest.mark.parametrize("config", ["int8 per channel", "int8 groups", "float8"])
def test_the_cuda_formats_tensors_come_back_too(tmp_path: Path, config: str) -> None:
    """The torchao tensors of rayrunner's CUDA formats, made on CPU (their classes and attributes are what counts)."""
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
    from torchao.quantization.granularity import PerGroup

    configs = {"int8 per channel": Int8WeightOnlyConfig(set_inductor_config=False),
               "int8 groups": IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerGroup(32)),
               "float8": Float8WeightOnlyConfig(set_inductor_config=False)}
    model = nn.Sequential(nn.Linear(64, 32, bias=False).to(torch.bfloat16))
    quantize_(model, configs[config])
    weight = model[0].weight
    save_tensors(tmp_path / "w.safetensors", [weight], None)
    [back], _ = load_tensors(tmp_path / "w.safetensors")
    assert type(back) is type(weight) and back.__tensor_flatten__()[1] == weight.__tensor_flatten__()[1]
    assert all(torch.equal(getattr(back, name), getattr(weight, name)) for name in weight.__tensor_flatten__()[0])


def _with_entries(path: Path, edit: Any) -> None:
    """Rewrite the file's tensor entries with `edit(entries)` (its storages kept), as a forger would."""
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    inner = json.loads(header["__metadata__"]["rayrunner"])
    inner["tensors"] = edit(inner["tensors"])
    header["__metadata__"]["rayrunner"] = json.dumps(inner)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


@pytest.mark.parametrize(("edit", "error"), [
    ({"shape": [1000]}, "outside its storage"),
    ({"offset": 10**6}, "outside its storage"),
    ({"dtype": "Tensor"}, "not a dtype"),
    ({"storage": "9@cpu"}, "no storage"),
    ({"class": "builtins.eval", "inner": {}, "attributes": None}, "not a tensor class"),
    ({"class": "torch.nested._internal.nested_tensor.NestedTensor", "inner": {}, "attributes": None},
     "not a tensor class"),  # registered as safe by torch, but not a torchao class
])
def test_forged_entries_are_refused(tmp_path: Path, edit: dict[str, Any], error: str) -> None:
    path = tmp_path / "forged.safetensors"
    save_tensors(path, [torch.zeros(4)], None)
    _with_entries(path, lambda entries: [{**entries[0], **edit}])
    with pytest.raises(ValueError, match=error):
        load_tensors(path)
    with pytest.raises(ValueError, match=error):
        load_tensors(path, copy=True)


def test_a_truncated_file_is_refused_when_read(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    save_tensors(path, [torch.zeros(64)], None)
    path.write_bytes(path.read_bytes()[:-16])
    with pytest.raises(ValueError, match="not where the header says"):
        load_tensors(path, copy=True)
