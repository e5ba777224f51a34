"""The prompt attention on AMX tiles (`prompt_attention`): causal attention of whole prompts and of chunks after
cached positions within one bf16 rounding of float32 attention, PyTorch's SDPA's outputs to the bit but for rare
last bits, the same on one thread and two; refused cleanly (past one block of keys too); and a bf16 prefill
through the fast step with it answering as transformers' does. Skipped without a C compiler or on CPUs without AMX
tiles."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rayrunner.engines.transformers.kv.kv_batch import BatchCache, new_cache
from rayrunner.engines.transformers.step import fast_decode, prompt_attention
from rayrunner.engines.transformers.step.fast_decode import FastDecode, PromptChunk
from rayrunner.quantization.cpu_gemm import amx_tiles
from rayrunner.runtime import native_build
from tests.engines.test_fast_decode import _calls, _model, _relative
from tests.tiny_models import build_kernel_llama

needs_tiles = pytest.mark.skipif(native_build.compiler() is None or not amx_tiles(),
                                 reason="the prompt attention needs a C compiler and a CPU with AMX tiles")


@pytest.fixture(autouse=True)
def switched_on(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """These tests run the kernel whatever the environment says (`RAYRUNNER_PROMPT_ATTENTION=0` turns it off)."""
    monkeypatch.setenv(prompt_attention.SWITCH_ENV, "1")
    prompt_attention.library.cache_clear()
    yield
    prompt_attention.library.cache_clear()  # monkeypatch puts the environment back after


def _attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
               dtype: torch.dtype) -> torch.Tensor:
    """SDPA in `dtype`, causal after `start` cached positions: [tokens, heads * dim]."""
    tokens, heads, dim = query.shape
    allowed = torch.ones(tokens, start + tokens, dtype=torch.bool).tril(start)
    out = F.scaled_dot_product_attention(query.to(dtype).transpose(0, 1)[None], keys.to(dtype)[None],
                                         values.to(dtype)[None], attn_mask=allowed, scale=dim ** -0.5,
                                         enable_gqa=True)
    return out[0].transpose(0, 1).reshape(tokens, heads * dim)


def _run(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, threads: int) -> torch.Tensor:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return prompt_attention.prompt_attention(query, keys, values, start, query.shape[-1] ** -0.5)
    finally:
        torch.set_num_threads(previous)


@needs_tiles
# tokens: one, a few, SmolLM2's prompt (124), past one block of scores' scratch (300); a chunk after cached ones;
# groups of 1-4 query heads a KV head; heads of 64 and 128
@pytest.mark.parametrize("tokens, start, heads, kv_heads, dim", [
    (1, 0, 4, 4, 64), (7, 0, 9, 3, 64), (124, 0, 9, 3, 64), (300, 0, 9, 3, 64), (33, 5, 9, 3, 64),
    (50, 100, 8, 2, 128), (17, 0, 2, 1, 128)])
def test_prompt_attention_is_float32_attention_within_bf16_rounding(tokens: int, start: int, heads: int,
                                                                    kv_heads: int, dim: int) -> None:
    torch.manual_seed(tokens + start + heads)
    rotated = torch.randn(tokens, heads + kv_heads, dim).to(torch.bfloat16)  # queries strided, as the step's are
    query = rotated[:, :heads]
    keys = torch.randn(kv_heads, start + tokens, dim).to(torch.bfloat16)
    values = torch.randn(kv_heads, start + tokens, dim).to(torch.bfloat16)
    got = _run(query, keys, values, start, threads=1)
    assert got.shape == (tokens, heads * dim) and got.dtype == torch.bfloat16
    exact = _attention(query, keys, values, start, torch.float32)
    sdpa = _attention(query, keys, values, start, torch.bfloat16).float()
    # the weights rounded to bf16 (as SDPA rounds them) and one rounding of the output: SDPA's error, no more
    assert (got.float() - exact).abs().max() <= (sdpa - exact).abs().max() * 1.25 + 1e-6
    # SDPA's softmax to the bit (measured: all but about one output in 20,000, where oneDNN sums the weighted values
    # in another order, one bf16 step apart)
    assert (got.float() != sdpa).float().mean() < 1e-3
    assert torch.equal(_run(query, keys, values, start, threads=2), got)


@needs_tiles
def test_prompt_attention_refuses_what_it_was_not_built_for() -> None:
    bf16 = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    assert not prompt_attention.attends(bf16, 3, 1, 96, 2) and not prompt_attention.attends(bf16, 3, 2, 64, 2)
    assert not prompt_attention.attends(bf16.float(), 3, 1, 64, 2)  # float32 keeps SDPA
    assert prompt_attention.attends(bf16, 3, 1, 64, prompt_attention.KEY_BLOCK)
    assert not prompt_attention.attends(bf16, 3, 1, 64, prompt_attention.KEY_BLOCK + 1)  # SDPA's softmax in blocks
    keys = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="keys"):
        prompt_attention.prompt_attention(bf16, keys, keys, 1, 0.125)  # 2 tokens after 1 need 3 positions
    with pytest.raises(ValueError, match="values"):
        prompt_attention.prompt_attention(bf16, keys, keys.transpose(1, 2).contiguous().transpose(1, 2), 0, 0.125)
    with pytest.raises(ValueError, match="query"):
        prompt_attention.prompt_attention(bf16.float(), keys, keys, 0, 0.125)


@needs_tiles
@pytest.mark.slow
@torch.inference_mode()
def test_a_bf16_prefill_with_the_tiles_answers_as_transformers(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two prompts prefilled together by the fast step (one whole, one after cached tokens): the kernel takes every
    layer of both, and each prompt's logits are transformers' own prefill's within bf16 rounding, its next token the
    same."""
    model = _model(build_kernel_llama(tmp_path), torch.bfloat16)
    fast = FastDecode.for_model(model)
    assert fast is not None
    calls = _calls(monkeypatch, prompt_attention, "prompts_attention")
    prompts = [[(7 * t + 3) % 60 + 2 for t in range(40)], [(5 * t + 1) % 60 + 2 for t in range(23)]]

    def empty() -> BatchCache:
        return BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long))

    def prefill(cache: BatchCache, tokens: list[int], start: int) -> torch.Tensor:
        mask = cache.mask_with(len(tokens))
        logits = model(input_ids=torch.tensor([tokens]), attention_mask=mask,
                       position_ids=torch.arange(start, start + len(tokens))[None], cache=cache.cache).logits
        cache.grew(mask)
        return logits[0, -1].float()

    want = [prefill(empty(), prompt, 0) for prompt in prompts]
    cached = empty()
    prefill(cached, prompts[1][:9], 0)
    got = fast.prefill([PromptChunk(prompts[0], 0, empty(), fast.heads),
                        PromptChunk(prompts[1][9:], 9, cached, fast.heads)]).float()
    assert [out.shape[0] for out in calls] == [40 + 14] * 2  # both prompts in one call a layer
    for row, expected in enumerate(want):
        assert _relative(got[row, -1], expected) < 0.02
        assert int(got[row, -1].argmax()) == int(expected.argmax())


@needs_tiles
@torch.inference_mode()
def test_a_prompt_after_its_cached_start_gets_its_whole_prefills_logits_to_the_bit(tmp_path: Path) -> None:
    """The prefix cache's promise: a prompt whose first tokens are cached (computed by an earlier whole prefill)
    gets the logits its own whole prefill gets, so a repeated question gets the same greedy answer."""
    model = _model(build_kernel_llama(tmp_path, seed=1), torch.bfloat16)
    fast = FastDecode.for_model(model)
    assert fast is not None
    prompt = [(11 * t + 5) % 60 + 2 for t in range(70)]

    def empty() -> BatchCache:
        return BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long))

    whole = fast.prefill([PromptChunk(prompt, 0, empty(), fast.heads)])
    cached = empty()
    fast.prefill([PromptChunk(prompt[:33], 0, cached, fast.heads)])
    after = fast.prefill([PromptChunk(prompt[33:], 33, cached, fast.heads)])
    assert torch.equal(whole, after)


@needs_tiles
def test_the_kernel_is_on_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default where the tiles are; `RAYRUNNER_PROMPT_ATTENTION=0` keeps SDPA."""
    query = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    monkeypatch.delenv(prompt_attention.SWITCH_ENV)
    prompt_attention.library.cache_clear()
    assert prompt_attention.attends(query, 3, 1, 64, 2)
    monkeypatch.setenv(prompt_attention.SWITCH_ENV, "0")
    prompt_attention.library.cache_clear()
    assert prompt_attention.library() is None
    assert not prompt_attention.attends(query, 3, 1, 64, 2)


@needs_tiles
@torch.inference_mode()
def test_prompts_attended_together_hold_what_each_alone_holds_to_the_bit(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts fed in one forward (one whole, two after cached tokens, the longest over several blocks of 16
    tokens) attend in one call a layer, their keys and values written into a cache tensor of their own: the logits
    and every layer's cached keys and values are those of each prompt attending on its own (`PromptChunk.attend`,
    through the cache's `update`)."""
    model = _model(build_kernel_llama(tmp_path, seed=2), torch.bfloat16)
    fast = FastDecode.for_model(model)
    assert fast is not None
    prompts = [[(7 * t + 3) % 60 + 2 for t in range(40)], [(5 * t + 1) % 60 + 2 for t in range(23)],
               [(3 * t + 2) % 60 + 2 for t in range(90)]]
    starts = [0, 9, 31]

    def fed() -> tuple[torch.Tensor, list[BatchCache]]:
        caches = [BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long)) for _ in prompts]
        for cache, prompt, start in zip(caches, prompts, starts, strict=True):
            if start:
                fast.prefill([PromptChunk(prompt[:start], 0, cache, fast.heads)])
        chunks = [PromptChunk(prompt[start:], start, cache, fast.heads)
                  for cache, prompt, start in zip(caches, prompts, starts, strict=True)]
        return fast.prefill(chunks), caches

    together_calls = _calls(monkeypatch, prompt_attention, "prompts_attention")
    together, together_caches = fed()
    assert len(together_calls) == 3 * 2  # the two prefixes, then all three prompts in one forward: a call a layer
    monkeypatch.setattr(fast_decode, "_prompts_table", lambda *args: None)
    alone, alone_caches = fed()
    assert torch.equal(together, alone)
    for mine, theirs in zip(together_caches, alone_caches, strict=True):
        assert torch.equal(mine.mask, theirs.mask)
        for layer, other in zip(_kv(mine), _kv(theirs), strict=True):
            assert torch.equal(layer[0], other[0]) and torch.equal(layer[1], other[1])


def _kv(cache: BatchCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers: list[Any] = list(cache.cache.layers)
    return [(layer.keys, layer.values) for layer in layers]
