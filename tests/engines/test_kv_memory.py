"""The KV memory budget on a tiny float32 Llama: admission within the budget, preemption (recompute) of the newest
sequences when running ones outgrow it, the measured bytes never past it, every reply exact; a prompt that cannot fit
is refused. The default budget: 1 GiB on CPU; on a GPU (tests marked `gpu`), part of the replica's share of it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler, scheduler_limits
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.errors import InvalidRequestError
from rayrunner.models.footprint import CPU_KV_BYTES, GPU_KV_FRACTION
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from tests.families.tiny_families import build


@pytest.fixture(scope="module")
def model(tiny_llama_dir: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _position_bytes(model: Any) -> int:
    scheduler = StepScheduler(model, SchedulerLimits())
    scheduler.memory.probe(model)
    return scheduler.memory.position_bytes


def _run(model: Any, tokenizer: Any, loop: asyncio.AbstractEventLoop, prompts: list[list[int]], max_tokens: int,
         **limits: Any) -> tuple[list[Sequence], StepScheduler, int]:
    """Submit all `prompts` at once (greedy, EOS ignored) and step until every one ends; the sequences, the
    scheduler, and the most bytes its caches held after any step."""
    scheduler = StepScheduler(model, SchedulerLimits(**limits))
    sequences = [Sequence(p, SamplingParams(max_tokens=max_tokens), Detokenizer(tokenizer, []), set(), loop)
                 for p in prompts]
    for sequence in sequences:
        scheduler.submit(sequence)
    peak = 0
    with torch.inference_mode():
        while not all(s.done for s in sequences):
            scheduler.step()
            peak = max(peak, scheduler.memory.held)
    return sequences, scheduler, peak


def _prompts(count: int, length: int) -> list[list[int]]:
    return [[(31 * t + 7 * i) % 4000 + 10 for t in range(length)] for i in range(count)]


@pytest.mark.slow
def test_eight_requests_of_1000_tokens_in_a_2000_token_budget(model: Any, tokenizer: Any,
                                                              loop: asyncio.AbstractEventLoop) -> None:
    budget = 2000 * _position_bytes(model)
    prompts = _prompts(8, 500)
    squeezed, scheduler, peak = _run(model, tokenizer, loop, prompts, 500, max_num_seqs=8, kv_cache_bytes=budget,
                                     prefill_chunk_tokens=256)
    roomy, _, _ = _run(model, tokenizer, loop, prompts, 500, max_num_seqs=8, prefill_chunk_tokens=256)
    assert not any(s.failed for s in squeezed)
    assert [len(s.output_ids) for s in squeezed] == [500] * 8
    assert 0 < peak <= budget  # measured from the caches' storages after every step
    assert scheduler.memory.preemptions > 0 and scheduler.stats()["preemptions"] == scheduler.memory.preemptions
    assert [s.output_ids for s in squeezed] == [s.output_ids for s in roomy]  # recomputed exactly


def test_a_prompt_past_the_budget_is_refused_and_others_go_on(model: Any, tokenizer: Any,
                                                              loop: asyncio.AbstractEventLoop) -> None:
    budget = 300 * _position_bytes(model)
    scheduler = StepScheduler(model, SchedulerLimits(kv_cache_bytes=budget, prefill_chunk_tokens=128))
    big, small = (Sequence(p, SamplingParams(max_tokens=4), Detokenizer(tokenizer, []), set(), loop)
                  for p in (_prompts(1, 400)[0], _prompts(1, 20)[0]))
    scheduler.submit(big)
    scheduler.submit(small)
    with torch.inference_mode():
        while not (big.done and small.done):
            scheduler.step()
    loop.run_until_complete(asyncio.sleep(0))  # the events handed over with call_soon_threadsafe
    error = big.events.get_nowait()
    assert isinstance(error, InvalidRequestError) and error.status == 400 and "kv_cache_bytes" in str(error)
    assert len(small.output_ids) == 4 and not small.failed


def test_a_sequence_alone_that_outgrows_the_budget_ends_with_length(model: Any, tokenizer: Any,
                                                                    loop: asyncio.AbstractEventLoop) -> None:
    budget = 200 * _position_bytes(model)
    (sequence,), _, peak = _run(model, tokenizer, loop, _prompts(1, 100), 400, kv_cache_bytes=budget)
    assert sequence.finished and not sequence.failed and 95 <= len(sequence.output_ids) <= 101  # up to the budget
    assert peak <= budget


@pytest.mark.parametrize("family", ["LFM2 (short convolutions + attention)",
                                    "Qwen3-Next (gated delta net + attention, MoE)"])
def test_a_hybrid_model_is_preempted_and_resumed_exactly(family: str, tokenizer: Any,
                                                          loop: asyncio.AbstractEventLoop) -> None:
    """Rows of recurrent states leave and join with their sequences: a squeezed run equals a roomy one."""
    model = build(family)
    model.generation_config.eos_token_id = None
    prompts = [[(31 * t + 7 * i) % 500 + 10 for t in range(40 + 10 * i)] for i in range(4)]
    probe = StepScheduler(model, SchedulerLimits())
    probe.memory.probe(model)
    budget = probe.memory.bytes_of(2, 120)  # two rows of 120 positions, states included
    squeezed, scheduler, peak = _run(model, tokenizer, loop, prompts, 60, kv_cache_bytes=budget)
    roomy, _, _ = _run(model, tokenizer, loop, prompts, 60)
    assert scheduler.memory.preemptions > 0 and peak <= budget
    assert [s.output_ids for s in squeezed] == [s.output_ids for s in roomy]


def test_the_default_budget_on_cpu_is_the_one_capacity_counts(model: Any) -> None:
    assert StepScheduler(model, SchedulerLimits()).memory.limit == CPU_KV_BYTES
    assert StepScheduler(model, SchedulerLimits(gpu_share=0.5)).memory.limit == CPU_KV_BYTES  # a GPU share, on CPU


def test_the_replica_s_gpu_share_reaches_the_scheduler() -> None:
    engine = build_spec("m", {"type": "plain", "model_id": "x"}, engine={"num_gpus": 0.25}).engine
    assert scheduler_limits(engine).gpu_share == 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replica_on_a_gpu_takes_part_of_its_share_of_the_device(tiny_llama_dir: str) -> None:
    """At `num_gpus: 0.5`: part of half the device less the tensors the process holds, so two such replicas fit on
    one GPU together whenever each starts; with no share reserved, part of what is free now."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).to("cuda")
    free, total = torch.cuda.mem_get_info()
    held = torch.cuda.memory_allocated()
    budget = StepScheduler(model, SchedulerLimits(gpu_share=0.5)).memory.limit
    assert budget == int((total // 2 - held) * GPU_KV_FRACTION) and 2 * (budget + held) <= total
    unshared = StepScheduler(model, SchedulerLimits()).memory.limit
    assert abs(unshared - free * GPU_KV_FRACTION) <= 64 << 20  # what is free moves a little as torch allocates
