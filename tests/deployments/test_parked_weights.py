"""Parked weights (pure torch, no Ray): every tensor comes back where it was, shared ones shared again, the file is
written once while the tensors stay the same, and files of exited processes are cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rayrunner.deployments.parked_weights import ParkedWeights
from rayrunner.quantization.int8_rows import Int8Linear


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(ids)))) * self.scale


def test_park_drops_every_tensor_and_restore_brings_the_same_ones_back(tmp_path: Path) -> None:
    model, ids = Tied(), torch.tensor([[1, 2, 3]])
    expected = model(ids)
    weights = ParkedWeights("tied", tmp_path)
    weights.park(model)
    assert weights.parked and model.body.weight is None and model.scale is None and model.head.weight is None
    weights.restore()
    assert not weights.parked
    assert torch.equal(model(ids), expected)
    assert model.head.weight is model.embed.weight  # tied again, not two copies


def test_weights_parked_in_host_memory_come_back_shared_and_as_parameters(tmp_path: Path) -> None:
    model, ids = Tied(), torch.tensor([[1, 2, 3]])
    expected = model(ids)
    weights = ParkedWeights("tied", tmp_path)
    with torch.inference_mode():  # as the step loop calls it
        weights.park(model, host_memory=True)
    assert weights.parked and model.body.weight is None and not weights.path.exists()  # no file
    with torch.inference_mode():
        weights.restore()
    assert not weights.parked
    assert model.head.weight is model.embed.weight and isinstance(model.body.weight, nn.Parameter)
    assert not any(tensor.is_inference() for tensor in model.state_dict().values())
    assert torch.equal(model(ids), expected)


def test_cpu_weights_go_to_the_file_by_default(tmp_path: Path) -> None:
    weights = ParkedWeights("tied", tmp_path)
    weights.park(Tied())
    assert weights.path.exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_weights_park_in_host_memory_and_free_the_gpu(tmp_path: Path) -> None:
    model, ids = Tied().cuda(), torch.tensor([[1, 2, 3]], device="cuda")
    expected = model(ids)
    before = torch.cuda.memory_allocated()
    weights = ParkedWeights("tied", tmp_path)
    weights.park(model)
    torch.cuda.empty_cache()
    assert not weights.path.exists() and torch.cuda.memory_allocated() < before
    weights.restore()
    assert model.body.weight.device.type == "cuda" and model.head.weight is model.embed.weight
    assert torch.equal(model(ids), expected)


def test_quantized_modules_park_and_come_back_exactly(tmp_path: Path) -> None:
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    model = nn.Sequential(Int8Linear.from_linear(linear))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    expected = model(x)
    weights = ParkedWeights("int8", tmp_path)
    weights.park(model)
    weights.restore()
    assert torch.equal(model(x), expected)


def test_the_file_is_written_again_only_when_the_tensors_changed(tmp_path: Path) -> None:
    model, weights = Tied(), ParkedWeights("once", tmp_path)
    weights.park(model)
    written = weights.path.stat().st_mtime_ns
    weights.restore()
    weights.park(model)
    assert weights.path.stat().st_mtime_ns == written
    weights.restore()
    model.extra = nn.Linear(8, 8)  # e.g. a LoRA adapter loaded since
    weights.park(model)
    assert weights.path.stat().st_mtime_ns != written
    weights.restore()
    assert model.extra.weight is not None
    weights.discard()
    assert not weights.path.exists()


def test_parked_files_of_exited_processes_are_removed(tmp_path: Path) -> None:
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    mine = ParkedWeights("mine", tmp_path)
    orphan = mine.path.with_name(mine.path.name.replace(f"-{os.getpid()}-", f"-{exited.stdout.strip()}-"))
    orphan.write_bytes(b"left by a replica that was killed asleep")
    other_host = tmp_path / f"some-other-host-{exited.stdout.strip()}-x.pt"
    other_host.write_bytes(b"another host's")
    mine.park(Tied())
    assert not orphan.exists() and mine.path.exists() and other_host.exists()
    orphan.write_bytes(b"left by a cluster that was stopped")
    ParkedWeights("next-replica", tmp_path)  # a replica starting on the host sweeps too
    assert not orphan.exists() and mine.path.exists()
