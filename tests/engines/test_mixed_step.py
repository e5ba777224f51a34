"""Prompts fed beside a decode step (`FastDecode.step` with `PromptChunk`s, vLLM's mixed batch): the decode rows get
the logits and cache they get alone, and each prompt the logits and cache of its own prefill by transformers'
forward, whole or as a chunk after cached positions, one or two at once, for a Llama and a Qwen3 (query and key
norms) in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayrunner.engines.transformers.kv.kv_batch import BatchCache, new_cache
from rayrunner.engines.transformers.step.fast_decode import FastDecode, PromptChunk
from tests.engines.test_fast_decode import _prefilled, _qwen3

ROWS = [[5, 9, 14, 3, 7], [21, 4, 8, 30, 11, 2, 19, 6, 12]]  # decoding, left-padded to 9 in one batch
PROMPTS = [[40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [60, 61, 62, 63, 64, 65, 66, 67]]


def _empty(model: torch.nn.Module) -> BatchCache:
    return BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long))


def _prefill(model: torch.nn.Module, cache: BatchCache, tokens: list[int], start: int) -> torch.Tensor:
    """transformers' forward over `tokens` after `start` cached ones: the last position's logits [1, vocab]."""
    mask = cache.mask_with(len(tokens))
    logits = model(input_ids=torch.tensor([tokens]), attention_mask=mask,
                   position_ids=torch.arange(start, start + len(tokens))[None], cache=cache.cache).logits
    cache.grew(mask)
    return logits[:, -1]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("starts", [[0], [5], [0, 5]])  # each prompt whole, or its tokens after 5 cached ones
@torch.inference_mode()
def test_prompts_beside_the_decode_rows_get_their_own_prefill_and_the_rows_theirs(tiny_llama_dir: str, kind: str,
                                                                                 starts: list[int]) -> None:
    model = _qwen3() if kind == "qwen3" else AutoModelForCausalLM.from_pretrained(tiny_llama_dir,
                                                                                  dtype=torch.float32).eval()
    fast = FastDecode.for_model(model)
    assert fast is not None and fast.mixes_prompts
    tokens = PROMPTS[: len(starts)]
    ids = torch.tensor([[row[-1]] for row in ROWS])
    alone_batch, alone_prompts = _prefilled(model, ROWS), [_empty(model) for _ in tokens]
    want_rows = fast.step(ids, alone_batch)
    want_prompts = [_prefill(model, cache, prompt, 0) for cache, prompt in zip(alone_prompts, tokens, strict=True)]

    batch, caches = _prefilled(model, ROWS), [_empty(model) for _ in tokens]
    for cache, prompt, start in zip(caches, tokens, starts, strict=True):
        if start:
            _prefill(model, cache, prompt[:start], 0)
    got = fast.step(ids, batch, [PromptChunk(prompt[start:], start, cache, fast.heads)
                                 for cache, prompt, start in zip(caches, tokens, starts, strict=True)])

    assert got.shape == (len(ROWS) + len(tokens), 1, model.config.vocab_size)
    torch.testing.assert_close(got[: len(ROWS)], want_rows, atol=1e-4, rtol=1e-4)
    for row, want in enumerate(want_prompts, start=len(ROWS)):
        torch.testing.assert_close(got[row], want, atol=1e-4, rtol=1e-4)
    assert batch.length == alone_batch.length
    assert [c.length for c in caches] == [len(p) for p in tokens] == [c.length for c in alone_prompts]
    for mine_cache, their_cache in [(batch, alone_batch), *zip(caches, alone_prompts, strict=True)]:
        for mine, theirs in zip(mine_cache.cache.layers, their_cache.cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@torch.inference_mode()
def test_prompts_prefilled_without_rows_get_their_own_prefill(tiny_llama_dir: str, kind: str) -> None:
    """`FastDecode.prefill` (prompts only, as the prefill thread feeds them): each prompt, whole or after 5 cached
    tokens, gets the logits and cache of its own prefill by transformers' forward."""
    model = _qwen3() if kind == "qwen3" else AutoModelForCausalLM.from_pretrained(tiny_llama_dir,
                                                                                  dtype=torch.float32).eval()
    fast = FastDecode.for_model(model)
    assert fast is not None and fast.prefills_aside
    alone = [_empty(model) for _ in PROMPTS]
    want = [_prefill(model, cache, prompt, 0) for cache, prompt in zip(alone, PROMPTS, strict=True)]
    caches, starts = [_empty(model) for _ in PROMPTS], [0, 5]
    _prefill(model, caches[1], PROMPTS[1][:5], 0)
    got = fast.prefill([PromptChunk(prompt[start:], start, cache, fast.heads)
                        for cache, prompt, start in zip(caches, PROMPTS, starts, strict=True)])
    assert got.shape == (len(PROMPTS), 1, model.config.vocab_size)
    for row, expected in enumerate(want):
        torch.testing.assert_close(got[row], expected, atol=1e-4, rtol=1e-4)
    assert [c.length for c in caches] == [len(p) for p in PROMPTS]
