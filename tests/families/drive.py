"""Driving the step scheduler by hand for the family tests: greedy replies of a batch of prompts, all joining one
running batch a step apart (busy) or one at a time (alone), as `test_batched_families` does, with an optional LoRA
adapter per prompt; and transformers' `generate` to compare them with."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence as Seq
from typing import Any

import torch

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.lora import LoraAdapters
from rayrunner.engines.transformers.step.fast_decode import FastDecode
from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.openai.sampling_params import SamplingParams
from tests.families.tiny_families import VOCAB

TOKENS = 10


def prompts(count: int = 8) -> list[list[int]]:
    """`count` prompts of 5 to 26 tokens (past the families' sliding window), different in every position."""
    return [[(7 * t + 11 * i) % (VOCAB - 5) + 3 for t in range(5 + 3 * i)] for i in range(count)]


def replies(model: Any, loop: asyncio.AbstractEventLoop, tokenizer: Any, prompt_ids: list[list[int]], busy: bool,
            adapters: LoraAdapters | None = None, adapter_names: Seq[str | None] | None = None,
            tokens: int = TOKENS,
            eos_ids: set[int] | None = None) -> tuple[list[list[int]], StepScheduler]:
    """Greedy replies of `tokens` tokens to `prompt_ids` through a `StepScheduler` with the fast decode step where it
    covers the model (as `StepScheduler.start` sets it): all joining one batch a step apart (`busy`), or one at a
    time. The model's EOS ends a reply only after `tokens` tokens (`min_tokens`), as `generate(min_new_tokens=...)`
    masks it: a random model's greedy choice is sometimes EOS, which a reply ignoring it would emit instead."""
    scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8, prefill_chunk_tokens=16), adapters=adapters)
    scheduler.fast_decode = FastDecode.for_model(model)
    names = adapter_names or [None] * len(prompt_ids)
    if eos_ids is None:
        eos = model.generation_config.eos_token_id
        eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    sequences = [Sequence(p, SamplingParams(max_tokens=tokens, min_tokens=tokens), Detokenizer(tokenizer, []), eos_ids,
                          loop, adapter=name)
                 for p, name in zip(prompt_ids, names, strict=True)]
    with torch.inference_mode():
        for sequence in sequences:
            scheduler.submit(sequence)
            scheduler.step()
            while not busy and not sequence.done:
                scheduler.step()
        while not all(s.done for s in sequences):
            scheduler.step()
    loop.run_until_complete(asyncio.sleep(0))  # deliver the events the sequences handed to the loop
    for sequence in sequences:
        failure = _failure(sequence)
        if failure is not None:
            raise failure
    return [s.output_ids for s in sequences], scheduler


def _failure(sequence: Sequence) -> BaseException | None:
    """The error a failed sequence put on its event queue (the scheduler logs it and goes on with the others)."""
    queue = sequence.events
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return next((item for item in items if isinstance(item, BaseException)), None)


def generate(model: Any, prompt: list[int], tokens: int = TOKENS, **inputs: Any) -> list[int]:
    """transformers' greedy `generate` of exactly `tokens` tokens after `prompt`."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False, **inputs)
    return out[0, len(prompt):].tolist()
