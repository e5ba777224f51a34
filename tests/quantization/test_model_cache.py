"""A model quantized in situ is cached whole on disk and loaded from there the next time (tiny random Llama, CPU)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayrunner.deployments.loading import Loaded, load_model
from rayrunner.models.spec import build_spec
from rayrunner.quantization.int8_rows import Int8Linear


@pytest.fixture
def weights(tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the tiny model (tests touch its files), with rayrunner's cache in `tmp_path/cache`."""
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path / "cache"))
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


def load(folder: Path, isq: str | None = "Q8_0", **engine: Any) -> Loaded:
    spec = build_spec("tiny", {"type": "plain", "model_id": str(folder)}, in_situ_quant=isq, engine=engine)
    return load_model(spec, AutoModelForCausalLM)


def cached_files(folder: Path) -> list[Path]:
    return sorted((folder.parent / "cache" / "quantized").glob("*.pt"))


def greedy(loaded: Loaded) -> list[int]:
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        output = loaded.model.generate(ids, max_new_tokens=8, do_sample=False)
    return [int(token) for token in output[0, ids.shape[1]:]]


@pytest.mark.parametrize("isq", ["Q8_0", "Q4K"])
def test_a_second_load_reads_the_quantized_model_and_answers_the_same(weights: Path, isq: str) -> None:
    first = load(weights, isq)
    [cached] = cached_files(weights)
    written = cached.stat()
    second = load(weights, isq)
    assert cached_files(weights) == [cached] and cached.stat().st_ino == written.st_ino  # read, not written again
    assert cached.stat().st_mtime_ns > written.st_mtime_ns  # marked used
    assert second.quantization == first.quantization
    assert [type(m) for m in second.model.modules()] == [type(m) for m in first.model.modules()]
    assert greedy(second) == greedy(first)
    assert not any(p.is_inference() for p in second.model.parameters())


def test_changed_weights_are_quantized_again_and_the_old_file_goes(weights: Path) -> None:
    load(weights)
    [old] = cached_files(weights)
    weights_file = weights / "model.safetensors"
    os.utime(weights_file, ns=(weights_file.stat().st_atime_ns, weights_file.stat().st_mtime_ns + 10**9))
    load(weights)
    [new] = cached_files(weights)
    assert new != old and not old.exists()


def test_an_unreadable_file_is_replaced_by_a_fresh_load(weights: Path) -> None:
    reference = greedy(load(weights))
    [cached] = cached_files(weights)
    cached.write_bytes(b"not a model")
    again = load(weights)
    assert greedy(again) == reference
    assert any(isinstance(m, Int8Linear) for m in again.model.modules())
    assert cached.stat().st_size > 1000  # written anew


def test_nothing_is_cached_without_isq_or_when_turned_off(weights: Path) -> None:
    load(weights, isq=None)
    load(weights, cache_quantized=False)
    assert cached_files(weights) == []


def test_a_full_folder_gives_up_the_least_recently_used_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from rayrunner.quantization.model_cache import LIMIT_ENV_VAR, QuantizedModelCache

    folder = tmp_path / "quantized"
    folder.mkdir()
    for age, name in enumerate(["newest", "middle", "oldest"]):
        (folder / f"{name}_0-0.pt").write_bytes(b"x" * 400_000)
        os.utime(folder / f"{name}_0-0.pt", (0, 1_000_000 - age))
    (folder / "dead.pt.1.partial").write_bytes(b"x")  # a writer that died an hour ago
    os.utime(folder / "dead.pt.1.partial", (0, 1_000_000))
    (folder / "busy.pt.2.partial").write_bytes(b"x")  # one writing now
    monkeypatch.setenv(LIMIT_ENV_VAR, str(500_000 / 2**30))
    cache = QuantizedModelCache(folder / "new_0-1.pt")
    cache.save(torch.nn.Linear(4, 4), {"applied": "test"})
    assert sorted(path.name for path in folder.glob("*.pt")) == ["new_0-1.pt", "newest_0-0.pt"]  # oldest first
    assert [path.name for path in folder.glob("*.partial")] == ["busy.pt.2.partial"]
    loaded = cache.load()
    assert loaded is not None and isinstance(loaded[0], torch.nn.Linear) and loaded[1] == {"applied": "test"}
