"""Parked weights (pure torch, no Ray): every tensor comes back where it was, shared ones shared again, the file is
written once while the tensors stay the same, holds data only (a planted pickle is never run), and files of exited
processes are cleaned up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from rayrunner.engines.parked_weights import ParkedWeights
from rayrunner.errors import ModelLoadError
from rayrunner.quantization import quantize_model
from rayrunner.quantization.int8_rows import Int8Linear
from rayrunner.quantization.weights import _plain_tensors


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_wake_on_a_gpu_copies_back_from_pinned_memory_at_the_buses_speed(tmp_path: Path) -> None:
    """Parked GPU weights wait in pinned host memory, and a wake copies ~1 GB back at >= 80% of the bandwidth a
    plain pinned-to-device copy of the same bytes reaches on this machine (the probe), best of three each."""
    import time

    model = nn.Sequential(*(nn.Linear(4096, 4096, bias=False) for _ in range(16))).cuda().to(torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    probe_host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    probe_device = torch.empty(size, dtype=torch.uint8, device="cuda")

    def best(work: Any) -> float:
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            started = time.perf_counter()
            work()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        return size / min(times)

    probe = best(lambda: probe_device.copy_(probe_host, non_blocking=True))
    weights = ParkedWeights("pinned", tmp_path)
    wakes = []
    for _ in range(3):
        weights.park(model)
        assert weights._in_host is not None and all(t.is_pinned() for t in weights._in_host[0])
        started = time.perf_counter()
        weights.restore()
        torch.cuda.synchronize()
        wakes.append(size / (time.perf_counter() - started))
    assert max(wakes) >= 0.8 * probe, (max(wakes) / 1e9, probe / 1e9)


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


class WritesMarker:
    """A pickle payload that creates a file when unpickled: what a planted parked file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_is_never_run(tmp_path: Path) -> None:
    model, weights = Tied(), ParkedWeights("planted", tmp_path)
    weights.park(model)
    marker = tmp_path / "the-pickle-ran"
    torch.save([WritesMarker(marker)], weights.path)  # as the pickled format wrote its files
    with pytest.raises(ModelLoadError, match="cannot be read"):
        weights.restore()
    assert not marker.exists()


def _plain_state(model: nn.Module) -> dict[str, list[torch.Tensor]]:
    return {f"{path}.{name}": list(_plain_tensors(tensor))
            for path, module in model.named_modules(remove_duplicate=False)
            for name, tensor in [*module._parameters.items(), *module._buffers.items()] if tensor is not None}


@pytest.mark.parametrize("isq", [None, "Q8_0", "Q4K"])  # bf16 as loaded, int8 rows, torchao int4 tensors
def test_a_model_comes_back_with_the_same_weights_and_greedy_answer(tiny_llama_dir: str, tmp_path: Path,
                                                                    isq: str | None) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    if isq is not None:
        quantize_model(model, isq, "cpu")
    prompt = torch.tensor([[1, 450, 7483, 310, 3444, 338]])
    with torch.inference_mode():
        expected = model.generate(prompt, max_new_tokens=8, do_sample=False)
    before = {name: [tensor.clone() for tensor in tensors] for name, tensors in _plain_state(model).items()}
    weights = ParkedWeights("tiny", tmp_path)
    weights.park(model, host_memory=False)
    assert weights.path.exists()
    weights.restore()
    after = _plain_state(model)
    assert after.keys() == before.keys()
    for name, tensors in before.items():
        assert [t.dtype for t in after[name]] == [t.dtype for t in tensors], name
        assert all(torch.equal(a, b) for a, b in zip(after[name], tensors, strict=True)), name
    with torch.inference_mode():
        assert torch.equal(model.generate(prompt, max_new_tokens=8, do_sample=False), expected)
    weights.discard()
