"""The decode step's layers in one C call (`decode_layers`): on a bf16 Llama packed for the AMX tiles its logits and
KV cache are the Python step's to the bit (rows of different lengths, one thread and two, the room growing), and
transformers' within bf16 rounding; prompts beside the rows, int8 weights and unpacked weights keep the Python step.
Skipped without a C compiler or on CPUs without AMX tiles."""

from __future__ import annotations

import pytest
import torch

from rayrunner.engines.transformers.kv.kv_batch import BatchCache, _layers, new_cache
from rayrunner.engines.transformers.step import decode_layers
from rayrunner.engines.transformers.step.fast_decode import FastDecode, PromptChunk
from rayrunner.quantization import packed_linear
from tests.engines.test_fast_decode import PROMPTS, _calls, _decode, _model, _prefilled, _relative
from tests.tiny_models import build_kernel_llama

needs_driver = pytest.mark.skipif(decode_layers.library() is None,
                                  reason="the layers in C need a C compiler and a CPU with AMX tiles")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_kernel_llama(tmp_path_factory.mktemp("kernel-llama"))


def _packed(folder: str) -> tuple[torch.nn.Module, FastDecode]:
    model = _model(folder, torch.bfloat16)
    packed_linear.pack_linears(model)
    fast = FastDecode.for_model(model)
    assert fast is not None
    return model, fast


def _without_driver(fast: FastDecode) -> FastDecode:
    fast.driver = None
    return fast


@needs_driver
@pytest.mark.parametrize("threads", [1, 2])
def test_the_layers_in_c_decode_as_the_python_step_to_the_bit(llama_dir: str, threads: int,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, fast = _packed(llama_dir)
        calls = _calls(monkeypatch, fast.driver, "run")
        got, got_cache = _decode(model, fast, steps=40)  # past the room reserved after the prefill: it grows
        assert len(calls) == 40 and None not in calls
        want, want_cache = _decode(model, _without_driver(_packed(llama_dir)[1]), steps=40)
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    for mine, theirs in zip(_layers(got_cache.cache), _layers(want_cache.cache), strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
    assert torch.equal(got_cache.mask, want_cache.mask)


@needs_driver
def test_the_layers_in_c_decode_as_transformers_within_bf16_rounding(llama_dir: str) -> None:
    model, fast = _packed(llama_dir)
    got, _ = _decode(model, fast, steps=6)
    want, _ = _decode(_model(llama_dir, torch.bfloat16), None, steps=6)  # transformers' forward, plain weights
    for got_logits, want_logits in zip(got, want, strict=True):
        assert _relative(got_logits, want_logits) < 0.02


@needs_driver
@torch.inference_mode()
def test_prompts_beside_the_rows_and_unpacked_weights_keep_the_python_step(llama_dir: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    model, fast = _packed(llama_dir)
    calls = _calls(monkeypatch, fast.driver, "run")
    batch = _prefilled(model)
    ids = torch.tensor([[prompt[-1]] for prompt in PROMPTS])
    empty = BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long))
    fast.step(ids, batch, [PromptChunk([3, 4, 5, 6], 0, empty, fast.heads)])
    assert calls == []  # a mixed step: the prompt's tokens ride in the Python step's matmuls
    packed_linear.unpack_linears(model)
    logits = fast.step(ids, batch)  # the Python step, on the plain weights
    assert calls == [None] and logits.shape == (len(PROMPTS), 1, 64)


@needs_driver
def test_int8_weights_keep_the_python_step(llama_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    int8 = _model(llama_dir, torch.bfloat16, "Q8_0")
    fast = FastDecode.for_model(int8)
    assert fast is not None and fast.driver is not None  # the layers' kinds fit...
    calls = _calls(monkeypatch, fast.driver, "run")
    got, _ = _decode(int8, fast, steps=3)
    assert calls == [None, None, None]  # ...but the weights are not on the tiles: the Python step ran
    want, _ = _decode(int8, _without_driver(fast), steps=3)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_switch_turns_the_layers_in_c_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(decode_layers.SWITCH_ENV, "0")
    decode_layers.library.cache_clear()
    try:
        assert decode_layers.library() is None
    finally:
        monkeypatch.delenv(decode_layers.SWITCH_ENV)
        decode_layers.library.cache_clear()
