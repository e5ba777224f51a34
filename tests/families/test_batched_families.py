"""Every family in `tiny_families`, hybrids of attention and recurrent layers included, decodes in one shared batch:
a greedy reply among 8 busy sequences joining at different steps equals the reply alone, and both equal
transformers' `generate` (float32). Families the fast decode step covers run it, as served; others run
transformers' forward on the same batch cache."""

from __future__ import annotations

import asyncio

import pytest

from tests.families.drive import generate, prompts, replies
from tests.families.tiny_families import FAMILIES, HYBRID_FAMILIES, build

FAST = {"Llama", "Mistral (sliding window)", "Ministral (sliding window)", "Qwen2", "Qwen3"}


@pytest.mark.parametrize("family", [*FAMILIES, *HYBRID_FAMILIES])
def test_greedy_in_a_busy_batch_equals_alone_and_generate(family: str, loop: asyncio.AbstractEventLoop,
                                                          tokenizer: object) -> None:
    model = build(family)
    busy, scheduler = replies(model, loop, tokenizer, prompts(), busy=True)
    alone, _ = replies(model, loop, tokenizer, prompts(), busy=False)
    assert scheduler.max_running == 8  # the family batches
    assert (scheduler.fast_decode is not None) == (family in FAST)
    assert busy == alone == [generate(model, p) for p in prompts()]
