"""`FastDecode` on tiny random models (Llama, Qwen3, LLaVA's language model): its decode step gives the logits and KV
cache of transformers' forward, for rows of different lengths (left padding), in float32 and with int8 weights that
share one tensor per layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    GPT2Config,
    GPT2LMHeadModel,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rayrunner.engines.parked_weights import ParkedWeights
from rayrunner.engines.transformers.kv.kv_batch import BatchCache, new_cache
from rayrunner.engines.transformers.step import fast_decode
from rayrunner.engines.transformers.step.fast_decode import SHARED_QDATA, SHARED_SCALE, FastDecode
from rayrunner.quantization import quantize_model, weight_bytes
from tests.tiny_models import build_tiny_llava

PROMPTS = [[5, 9, 14, 3, 7], [21, 4, 8, 30, 11, 2, 19, 6, 12], [40, 41, 42]]  # left-padded to 9 in one batch


def _model(folder: str, dtype: torch.dtype, isq: str | None = None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    if isq is not None:
        quantize_model(model, isq, "cpu")
    return model


@torch.inference_mode()
def _prefilled(model: torch.nn.Module, prompts: list[list[int]] = PROMPTS) -> BatchCache:
    """A batch of `prompts`, each prefilled alone and merged (as the scheduler does)."""
    batch = None
    for prompt in prompts:
        cache = BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long, device=model.device))
        mask = cache.mask_with(len(prompt))
        model(input_ids=torch.tensor([prompt], device=model.device), attention_mask=mask,
              position_ids=torch.arange(len(prompt), device=model.device)[None], cache=cache.cache)
        cache.grew(mask)
        if batch is None:
            batch = cache
        else:
            batch.merge(cache)
    assert batch is not None
    return batch


def _step(model: torch.nn.Module, fast: FastDecode | None, ids: torch.Tensor, batch: BatchCache) -> torch.Tensor:
    """One decode step of `ids` [rows, 1] over `batch`: transformers' forward (`fast` None) or the fast step."""
    if fast is not None:
        return fast.step(ids, batch)
    mask = batch.mask_with(1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.next_positions(), cache=batch.cache,
                   logits_to_keep=1).logits
    batch.grew(mask)
    return logits


@torch.inference_mode()
def _decode(model: torch.nn.Module, fast: FastDecode | None, steps: int) -> tuple[list[torch.Tensor], BatchCache]:
    """`steps` greedy decode steps over the batch: each step's logits, and the cache at the end."""
    batch = _prefilled(model)
    ids = torch.tensor([[prompt[-1]] for prompt in PROMPTS], device=model.device)
    every = []
    for _ in range(steps):
        logits = _step(model, fast, ids, batch)
        every.append(logits.float())
        ids = logits[:, -1].argmax(-1, keepdim=True)
    return every, batch


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _calls(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[Any]:
    """What each call of `owner.name` returns from now on (the calls still run it)."""
    results: list[Any] = []
    function = getattr(owner, name)

    def recorded(*args: Any) -> Any:
        results.append(result := function(*args))
        return result

    monkeypatch.setattr(owner, name, recorded)
    return results


def _qwen3() -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen3ForCausalLM(config).eval()


def _llava(folder: Path) -> torch.nn.Module:
    return AutoModelForImageTextToText.from_pretrained(build_tiny_llava(folder), dtype=torch.float32).eval()


@pytest.mark.slow
@pytest.mark.parametrize("amx", [False, True], ids=["two-matmuls", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen3", "llava"])
def test_float32_step_matches_transformers_forward(tiny_llama_dir: str, tmp_path: Path, kind: str, amx: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # either attention, whatever this CPU has: the two matmuls (no AMX) or PyTorch's SDPA (AMX tiles)
    monkeypatch.setattr(fast_decode, "amx_tiles", lambda: amx)
    model = {"llama": lambda: _model(tiny_llama_dir, torch.float32), "qwen3": _qwen3,
             "llava": lambda: _llava(tmp_path)}[kind]()
    fast = FastDecode.for_model(model)
    assert fast is not None
    want, want_cache = _decode(model, None, steps=4)
    got, got_cache = _decode(model, fast, steps=4)
    for got_logits, want_logits in zip(got, want, strict=True):
        assert got_logits.shape == want_logits.shape == (len(PROMPTS), 1, model.config.get_text_config().vocab_size)
        assert _relative(got_logits, want_logits) < 1e-4
    for mine, theirs in zip(got_cache.cache.layers, want_cache.cache.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-5) and torch.allclose(mine.values, theirs.values,
                                                                                     atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_on_cuda_matches_transformers_forward(tiny_llama_dir: str, dtype: torch.dtype) -> None:
    model = _model(tiny_llama_dir, dtype).to("cuda")
    fast = FastDecode.for_model(model)
    assert fast is not None
    want, _ = _decode(model, None, steps=4)
    got, cache = _decode(model, fast, steps=4)
    assert cache.cache.layers[0].keys.device.type == "cuda"
    for got_logits, want_logits in zip(got, want, strict=True):
        assert _relative(got_logits, want_logits) < (1e-4 if dtype == torch.float32 else 0.02)


@pytest.mark.slow
def test_int8_weights_share_one_tensor_per_layer_and_decode_alike(tiny_llama_dir: str) -> None:
    model = _model(tiny_llama_dir, torch.bfloat16, "Q8_0")
    want, _ = _decode(model, None, steps=4)
    size = weight_bytes(model)
    fast = FastDecode.for_model(model)
    assert fast is not None
    assert weight_bytes(model) == size  # views of the shared tensors, no second copy
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for owner, names in ((attention, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))):
        shared = getattr(owner, SHARED_QDATA)
        assert shared.shape[0] == sum(getattr(owner, name).out_features for name in names)
        assert all(getattr(owner, name).qdata.untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
                   for name in names)
    got, _ = _decode(model, fast, steps=4)
    for got_logits, want_logits in zip(got, want, strict=True):
        assert _relative(got_logits, want_logits) < 0.02  # bf16: attention is computed another way
    assert [step.argmax(-1).tolist() for step in got] == [step.argmax(-1).tolist() for step in want]


@pytest.mark.slow
def test_parked_and_restored_weights_keep_their_sharing(tiny_llama_dir: str, tmp_path: Path) -> None:
    model = _model(tiny_llama_dir, torch.bfloat16, "Q8_0")
    fast = FastDecode.for_model(model)
    assert fast is not None
    before, _ = _decode(model, fast, steps=2)
    parked = ParkedWeights("tiny", tmp_path)
    parked.park(model)
    assert getattr(model.model.layers[0].self_attn, SHARED_QDATA) is None  # freed while asleep
    parked.restore()
    attention = model.model.layers[0].self_attn
    assert (attention.q_proj.qdata.untyped_storage().data_ptr()
            == getattr(attention, SHARED_QDATA).untyped_storage().data_ptr())
    assert getattr(attention, SHARED_SCALE) is not None
    after, _ = _decode(model, fast, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    parked.discard()


def test_models_it_does_not_cover_keep_their_own_forward(tiny_llama_dir: str) -> None:
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4))
    assert FastDecode.for_model(gpt2) is None
    hooked = _model(tiny_llama_dir, torch.float32)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *_: None)
    assert FastDecode.for_model(hooked) is None


@pytest.mark.parametrize("rows", [1, 20])  # the int8 kernel's row count, and past it (conversion)
def test_batch_sizes_on_both_int8_paths_match_the_forward(tiny_llama_dir: str, rows: int) -> None:
    model = _model(tiny_llama_dir, torch.bfloat16, "Q8_0")
    fast = FastDecode.for_model(model)
    assert fast is not None
    prompt = torch.arange(6).repeat(rows, 1) + torch.arange(rows)[:, None]
    logits = []
    for step in (None, fast):
        with torch.inference_mode():
            batch = BatchCache(new_cache(model.config), torch.zeros((rows, 0), dtype=torch.long))
            mask = batch.mask_with(6)
            model(input_ids=prompt, attention_mask=mask, position_ids=torch.arange(6).repeat(rows, 1),
                  cache=batch.cache)
            batch.grew(mask)
            out = _step(model, step, prompt[:, -1:], batch)
        logits.append(out.float())
    assert logits[1].shape == logits[0].shape == (rows, 1, model.config.vocab_size)
    assert _relative(logits[1], logits[0]) < 0.02
