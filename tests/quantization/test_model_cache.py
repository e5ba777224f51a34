"""A model quantized in situ is cached on disk as data only and loaded from there the next time (tiny random Llama,
CPU): the same weights and greedy answers come back, a file that would run code is never run, and the file's key
follows the source's bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

from rayrunner.engines.loading import Loaded, load_model
from rayrunner.models.spec import build_spec
from rayrunner.quantization import model_cache
from rayrunner.quantization.int8_rows import Int8Linear
from rayrunner.quantization.model_cache import LIMIT_ENV_VAR, QuantizedModelCache
from rayrunner.quantization.tied_embedding import Int8Embedding
from rayrunner.quantization.weights import _class_name, _plain_tensors, load_tensors, save_tensors


@pytest.fixture
def weights(tiny_llama_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the tiny model (tests touch its files), with rayrunner's cache in `tmp_path/cache`."""
    monkeypatch.setenv("RAYRUNNER_CACHE_DIR", str(tmp_path / "cache"))
    return Path(shutil.copytree(tiny_llama_dir, tmp_path / "model"))


@pytest.fixture
def tied_weights(weights: Path) -> Path:
    """The tiny model with its lm_head tied to the embedding (its int8 table is then shared by two modules)."""
    config = AutoConfig.from_pretrained(weights)
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(weights)
    return weights


def load(folder: Path, isq: str | None = "Q8_0", **engine: Any) -> Loaded:
    spec = build_spec("tiny", {"type": "plain", "model_id": str(folder)}, in_situ_quant=isq, engine=engine)
    return load_model(spec, AutoModelForCausalLM)


def cached_files(folder: Path) -> list[Path]:
    return sorted((folder.parent / "cache" / "quantized").glob("*.safetensors"))


def greedy(loaded: Loaded) -> list[int]:
    ids = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.inference_mode():
        output = loaded.model.generate(ids, max_new_tokens=8, do_sample=False)
    return [int(token) for token in output[0, ids.shape[1]:]]


def plain_state(model: torch.nn.Module) -> dict[str, list[torch.Tensor]]:
    """Every parameter and buffer (non-persistent ones too) as the plain tensors it is made of."""
    return {f"{path}.{name}": list(_plain_tensors(tensor))
            for path, module in model.named_modules(remove_duplicate=False)
            for name, tensor in [*module._parameters.items(), *module._buffers.items()] if tensor is not None}


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    got_state, want_state = plain_state(got), plain_state(want)
    assert got_state.keys() == want_state.keys()
    for name, tensors in want_state.items():
        assert [(t.dtype, t.shape) for t in got_state[name]] == [(t.dtype, t.shape) for t in tensors], name
        assert all(torch.equal(a, b) for a, b in zip(got_state[name], tensors, strict=True)), name


class WritesMarker:
    """A pickle payload that creates a file when unpickled: what a planted cache file would carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


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
    assert_same_weights(second.model, first.model)
    assert greedy(second) == greedy(first)
    assert not any(p.is_inference() for p in second.model.parameters())
    assert not second.model.training and second.model.generation_config == first.model.generation_config


@pytest.mark.parametrize("isq", ["Q8_0", "Q4K"])
def test_a_tied_embedding_comes_back_as_one_table_for_both_ends(tied_weights: Path, isq: str) -> None:
    first = load(tied_weights, isq)
    second = load(tied_weights, isq)
    embedding, head = second.model.get_input_embeddings(), second.model.get_output_embeddings()
    assert isinstance(embedding, Int8Embedding) and head.table is embedding.table
    assert_same_weights(second.model, first.model)
    assert greedy(second) == greedy(first)


def test_a_planted_pickle_is_never_run_and_the_model_loads_from_its_source(weights: Path, tmp_path: Path) -> None:
    reference = greedy(load(weights))
    [cached] = cached_files(weights)
    marker = tmp_path / "the-pickle-ran"
    torch.save({"model": WritesMarker(marker)}, cached)  # as the pickled format wrote its files
    again = load(weights)
    assert not marker.exists()
    assert greedy(again) == reference and any(isinstance(m, Int8Linear) for m in again.model.modules())
    assert cached.stat().st_size > 1000  # written anew


def test_a_file_naming_a_class_outside_torchao_is_refused(weights: Path, tmp_path: Path) -> None:
    """A well-formed file whose tensor entry names another class (here a path class that would create a file were
    it called) is refused, not called; so is an enum of another package."""
    load(weights)
    [cached] = cached_files(weights)
    marker = tmp_path / "the-class-ran"
    save_tensors(cached, [torch.zeros(2)], {})
    assert len(load_tensors(cached)[0]) == 1  # a valid file, edited below as an attacker would
    forged = {"shape": [2], "stride": [1], "parameter": False, "grad": False, "class": "pathlib.Path.touch",
              "attributes": {"dict": {"self": str(marker)}}, "inner": {}}
    _rewrite_entries(cached, [forged])
    with pytest.raises(ValueError, match="not a tensor class"):
        load_tensors(cached)
    from torchao.prototype.quantization.int4 import Int4OpaqueTensor

    _rewrite_entries(cached, [{**forged, "class": _class_name(Int4OpaqueTensor),
                               "attributes": {"enum": "signal.Signals", "name": "SIGKILL"}}])
    with pytest.raises(ValueError, match="not an enum"):
        load_tensors(cached)
    assert not marker.exists()


def _rewrite_entries(path: Path, entries: list[Any]) -> None:
    """The file at `path` with its tensor entries replaced (its storages kept)."""
    import json
    import struct

    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    inner = json.loads(header["__metadata__"]["rayrunner"])
    inner["tensors"] = entries
    header["__metadata__"]["rayrunner"] = json.dumps(inner)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def test_the_key_follows_the_source_bytes_even_with_size_and_mtime_kept(weights: Path) -> None:
    load(weights)
    [old] = cached_files(weights)
    weights_file = weights / "model.safetensors"
    before = weights_file.stat()
    os.utime(weights_file, ns=(before.st_atime_ns, before.st_mtime_ns + 10**9))  # touched, same bytes
    load(weights)
    assert cached_files(weights) == [old]  # the same content: the same file
    touched = weights_file.stat()
    data = bytearray(weights_file.read_bytes())
    data[-1] ^= 0x01  # the last byte of the last tensor: a valid file, one weight changed
    weights_file.write_bytes(bytes(data))
    os.utime(weights_file, ns=(touched.st_atime_ns, touched.st_mtime_ns))
    assert (weights_file.stat().st_size, weights_file.stat().st_mtime_ns) == (touched.st_size, touched.st_mtime_ns)
    load(weights)
    [new] = cached_files(weights)
    assert new != old and not old.exists()


def test_an_unchanged_source_is_not_hashed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = tmp_path / "model"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"weights")
    (source / "config.json").write_text("{}")
    (source / "README.md").write_text("not hashed")
    memo = tmp_path / "cache" / model_cache.HASHES_FILE
    hashed: list[str] = []
    real = model_cache.file_sha256
    monkeypatch.setattr(model_cache, "file_sha256", lambda path: hashed.append(path.name) or real(path))
    first = model_cache.source_digests(source, memo)
    assert sorted(hashed) == ["config.json", "model.safetensors"] and memo.is_file()
    assert model_cache.source_digests(source, memo) == first and len(hashed) == 2  # remembered
    stat = (source / "config.json").stat()
    (source / "config.json").write_text("[]")
    os.utime(source / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = model_cache.source_digests(source, memo)
    assert hashed[2:] == ["config.json"] and changed != first


def test_a_cache_file_of_another_model_shape_is_not_used(weights: Path) -> None:
    load(weights)
    [cached] = cached_files(weights)
    config = AutoConfig.from_pretrained(weights)
    config.num_hidden_layers = 1
    assert QuantizedModelCache(cached).load(AutoModelForCausalLM, config, torch.bfloat16) is None
    assert not cached.exists()


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
    folder = tmp_path / "quantized"
    folder.mkdir()
    for age, name in enumerate(["newest", "middle", "oldest"]):
        (folder / f"{name}_0-0.safetensors").write_bytes(b"x" * 400_000)
        os.utime(folder / f"{name}_0-0.safetensors", (0, 1_000_000 - age))
    (folder / "dead.safetensors.1.partial").write_bytes(b"x")  # a writer that died an hour ago
    os.utime(folder / "dead.safetensors.1.partial", (0, 1_000_000))
    (folder / "busy.safetensors.2.partial").write_bytes(b"x")  # one writing now
    (folder / "old_0-0.pt").write_bytes(b"a pickle of the previous format")
    monkeypatch.setenv(LIMIT_ENV_VAR, str(500_000 / 2**30))
    cache = QuantizedModelCache(folder / "new_0-1.safetensors")
    cache.save(torch.nn.Linear(4, 4), {"applied": "test"})
    assert sorted(path.name for path in folder.glob("*.safetensors")) == ["new_0-1.safetensors",
                                                                          "newest_0-0.safetensors"]  # oldest first
    assert [path.name for path in folder.glob("*.partial")] == ["busy.safetensors.2.partial"]
    assert not list(folder.glob("*.pt"))

