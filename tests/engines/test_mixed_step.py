"""A prompt fed beside a decode step (`FastDecode.step` with a `PromptChunk`, vLLM's mixed batch): the decode rows get
the logits and cache they get alone, and the prompt the logits and cache of its own prefill by transformers' forward,
whole or as a chunk after cached positions, for a Llama and a Qwen3 (query and key norms) in float32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayrunner.engines.transformers.kv.kv_batch import BatchCache, new_cache
from rayrunner.engines.transformers.step.fast_decode import FastDecode, PromptChunk
from tests.engines.test_fast_decode import _prefilled, _qwen3

ROWS = [[5, 9, 14, 3, 7], [21, 4, 8, 30, 11, 2, 19, 6, 12]]  # decoding, left-padded to 9 in one batch
PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]


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
@pytest.mark.parametrize("start", [0, 5])  # the whole prompt, or its tokens after 5 cached ones
@torch.inference_mode()
def test_a_prompt_beside_the_decode_rows_gets_its_own_prefill_and_the_rows_theirs(tiny_llama_dir: str, kind: str,
                                                                                   start: int) -> None:
    model = _qwen3() if kind == "qwen3" else AutoModelForCausalLM.from_pretrained(tiny_llama_dir,
                                                                                  dtype=torch.float32).eval()
    fast = FastDecode.for_model(model)
    assert fast is not None and fast.mixes_prompts
    ids = torch.tensor([[row[-1]] for row in ROWS])
    alone_batch, alone_prompt = _prefilled(model, ROWS), _empty(model)
    want_rows = fast.step(ids, alone_batch)
    want_prompt = _prefill(model, alone_prompt, PROMPT, 0)

    batch, prompt = _prefilled(model, ROWS), _empty(model)
    if start:
        _prefill(model, prompt, PROMPT[:start], 0)
    got = fast.step(ids, batch, PromptChunk(PROMPT[start:], start, prompt, fast.heads))

    assert got.shape == (len(ROWS) + 1, 1, model.config.vocab_size)
    torch.testing.assert_close(got[:-1], want_rows, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[-1], want_prompt, atol=1e-4, rtol=1e-4)
    assert batch.length == alone_batch.length and prompt.length == len(PROMPT) == alone_prompt.length
    for caches in ((batch, alone_batch), (prompt, alone_prompt)):
        for mine, theirs in zip(caches[0].cache.layers, caches[1].cache.layers, strict=True):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
