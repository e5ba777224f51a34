"""Every family in `tiny_families`, hybrids of attention and recurrent layers included, decodes in one shared batch:
a greedy reply among 8 busy sequences joining at different steps equals the reply alone, and both equal
transformers' `generate` (float32). Families the fast decode step covers run it, as served; others run
transformers' forward on the same batch cache."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoTokenizer

from rayrunner.deployments.sampling_params import SamplingParams
from rayrunner.deployments.step.detokenizer import Detokenizer
from rayrunner.deployments.step.fast_decode import FastDecode
from rayrunner.deployments.step.scheduler import SchedulerLimits, StepScheduler
from rayrunner.deployments.step.sequence import Sequence
from rayrunner.models.sources import SMOLLM2, resolve
from tests.families.tiny_families import FAMILIES, HYBRID_FAMILIES, VOCAB, build

TOKENS = 10
FAST = {"Llama", "Mistral (sliding window)", "Ministral (sliding window)", "Qwen2", "Qwen3"}


def _prompts() -> list[list[int]]:
    """8 prompts of 5 to 26 tokens (past the sliding window), different in every position."""
    return [[(7 * t + 11 * i) % (VOCAB - 5) + 3 for t in range(5 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)


def _replies(model: object, loop: asyncio.AbstractEventLoop, tokenizer: object, busy: bool) -> tuple[list[list[int]],
                                                                                                        StepScheduler]:
    """Greedy replies to `_prompts()`: all 8 joining one batch a step apart (`busy`), or one at a time."""
    scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8, prefill_chunk_tokens=16))
    scheduler.fast_decode = FastDecode.for_model(model)
    sequences = [Sequence(p, SamplingParams(max_tokens=TOKENS), Detokenizer(tokenizer, []), set(), loop)
                 for p in _prompts()]
    for sequence in sequences:
        scheduler.submit(sequence)
        scheduler.step()
        while not busy and not sequence.done:
            scheduler.step()
    while not all(s.done for s in sequences):
        scheduler.step()
    return [s.output_ids for s in sequences], scheduler


@pytest.mark.parametrize("family", [*FAMILIES, *HYBRID_FAMILIES])
def test_greedy_in_a_busy_batch_equals_alone_and_generate(family: str, loop: asyncio.AbstractEventLoop,
                                                          tokenizer: object) -> None:
    model = build(family)
    with torch.inference_mode():
        busy, scheduler = _replies(model, loop, tokenizer, busy=True)
        alone, _ = _replies(model, loop, tokenizer, busy=False)
        model.generation_config.eos_token_id = None  # as the scheduler's sequences here: no EOS ends a reply
        generated = [model.generate(torch.tensor([p]), max_new_tokens=TOKENS, do_sample=False)[0, len(p):].tolist()
                     for p in _prompts()]
    assert scheduler.max_running == 8  # the family batches
    assert (scheduler.fast_decode is not None) == (family in FAST)
    assert busy == alone == generated
