"""Prefix reuse: a prompt starting with blocks already computed prefills only the rest and replies exactly as without
reuse (float32, greedy), a chat's next turn reuses the previous turn's prompt and reply, blocks stay within the KV
budget; and `PrefixCache` alone: longest prefix, adapters apart, least recently used dropped from a prefix's end."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.transformers.kv.prefix_cache import BLOCK, PrefixCache
from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.openai.sampling_params import SamplingParams
from tests.families.tiny_families import build


def _reply(scheduler: StepScheduler, tokenizer: Any, loop: asyncio.AbstractEventLoop, prompt: list[int],
           tokens: int = 8) -> Sequence:
    sequence = Sequence(prompt, SamplingParams(max_tokens=tokens), Detokenizer(tokenizer, []), set(), loop)
    scheduler.submit(sequence)
    with torch.inference_mode():
        while not sequence.done:
            scheduler.step()
    return sequence


SYSTEM = [(13 * t) % 3000 + 20 for t in range(100)]  # 6 full blocks and 4 tokens


@pytest.mark.parametrize("family", ["llama", "Gemma 2 (sliding + full)"])
def test_a_shared_start_is_reused_and_replies_stay_exact(family: str, tiny_llama_dir: str, tokenizer: Any,
                                                         loop: asyncio.AbstractEventLoop) -> None:
    model = (AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval() if family == "llama"
             else build(family))
    vocab = int(model.config.vocab_size)
    questions = [[(7 * t + 3 * i) % (vocab - 10) + 5 for t in range(9 + i)] for i in range(3)]
    reuse = StepScheduler(model, SchedulerLimits(prefill_chunk_tokens=32))
    fresh = StepScheduler(model, SchedulerLimits(prefill_chunk_tokens=32, prefix_caching=False))
    system = [t % (vocab - 10) + 5 for t in SYSTEM]
    for question in questions:
        reused = _reply(reuse, tokenizer, loop, system + question)
        alone = _reply(fresh, tokenizer, loop, system + question)
        assert reused.output_ids == alone.output_ids
        assert alone.cached_tokens == 0
    assert reused.cached_tokens == len(system) // BLOCK * BLOCK  # the third asker took the shared blocks
    assert fresh.memory.prefix is None and reuse.memory.prefix is not None and reuse.memory.prefix.nbytes > 0


def test_blocks_are_shared_only_within_a_cache_salt(tiny_llama_dir: str, tokenizer: Any,
                                                    loop: asyncio.AbstractEventLoop) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    scheduler = StepScheduler(model, SchedulerLimits(prefill_chunk_tokens=64))

    def salted(salt: str | None) -> Sequence:
        sequence = Sequence(SYSTEM + [5, 6], SamplingParams(max_tokens=2, cache_salt=salt), Detokenizer(tokenizer, []),
                            set(), loop)
        scheduler.submit(sequence)
        with torch.inference_mode():
            while not sequence.done:
                scheduler.step()
        return sequence

    assert salted("tenant-a").cached_tokens == 0
    assert salted("tenant-b").cached_tokens == 0 and salted(None).cached_tokens == 0
    assert salted("tenant-a").cached_tokens == len(SYSTEM) // BLOCK * BLOCK


def test_the_next_turn_reuses_the_prompt_and_the_reply(tiny_llama_dir: str, tokenizer: Any,
                                                       loop: asyncio.AbstractEventLoop) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    scheduler = StepScheduler(model, SchedulerLimits(prefill_chunk_tokens=64))
    first = _reply(scheduler, tokenizer, loop, SYSTEM, tokens=40)
    turn = SYSTEM + first.output_ids + [5, 6, 7]
    second = _reply(scheduler, tokenizer, loop, turn)
    cached = (len(SYSTEM) + 40 - 1) // BLOCK * BLOCK  # the reply's last token was never fed
    assert second.cached_tokens == cached
    fresh = StepScheduler(model, SchedulerLimits(prefill_chunk_tokens=64, prefix_caching=False))
    assert _reply(fresh, tokenizer, loop, turn).output_ids == second.output_ids


def test_blocks_stay_within_the_budget(tiny_llama_dir: str, tokenizer: Any, loop: asyncio.AbstractEventLoop) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    probe = StepScheduler(model, SchedulerLimits())
    probe.memory.probe(model)
    budget = 300 * probe.memory.position_bytes
    scheduler = StepScheduler(model, SchedulerLimits(kv_cache_bytes=budget))
    for i in range(6):  # 6 x 150 cached positions: more than the budget holds
        _reply(scheduler, tokenizer, loop, [(17 * t + i) % 3000 + 20 for t in range(150)])
        assert scheduler.memory.held <= budget
    assert scheduler.memory.prefix is not None
    assert 0 < scheduler.memory.prefix.nbytes <= budget


def _kv(start: int, end: int) -> torch.Tensor:
    return torch.full((1, 2, 1, end - start, 2), float(start))


def test_prefix_cache_finds_the_longest_start_per_adapter_and_drops_a_prefix_from_its_end() -> None:
    cache = PrefixCache()
    ids = list(range(5 * BLOCK))
    cache.store(ids, None, _kv, lambda nbytes: True)
    assert len(cache.lookup(ids, None)) == 4  # the last token is always prefilled
    assert len(cache.lookup(ids + [1], None)) == 5
    assert len(cache.lookup(ids[:BLOCK] + [9] * BLOCK + [1], None)) == 1
    assert cache.lookup(ids + [1], "adapter") == []
    assert [block[0][0][0, 0, 0].item() for block in cache.lookup(ids + [1], None)] == [0, 16, 32, 48, 64]
    per_block = cache.nbytes // 5
    assert cache.evict(2 * per_block) == 2 * per_block
    assert len(cache.lookup(ids + [1], None)) == 3  # its last two blocks went first
    cache.store(list(range(100, 100 + 3 * BLOCK)), None, _kv, lambda nbytes: cache.nbytes + nbytes <= 4 * per_block)
    assert cache.nbytes == 4 * per_block  # `room` said no past one more block
