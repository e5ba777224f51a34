"""The step scheduler on a CUDA replica: the same batch joins and leaves, with the cache and sampling on the GPU.

Skipped without a GPU (none on the CI machine); run them where one is lent: `pytest -m gpu tests/engines`.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.engines.transformers.text import TextEngine
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_joining_and_leaving_keeps_each_sequence_exact_on_cuda(tiny_llama_dir: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).to("cuda")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    loop = asyncio.new_event_loop()
    prompts = [[1, 2, 3], list(range(20, 60)), [9] * 7, list(range(100, 113))]

    def run(batched: bool, **sampling: float) -> list[list[int]]:
        scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8, prefill_chunk_tokens=16))
        seqs = [Sequence(p, SamplingParams(max_tokens=6 + 3 * i, seed=i, **sampling), Detokenizer(tokenizer, []),
                         set(), loop) for i, p in enumerate(prompts)]
        for s in seqs:
            scheduler.submit(s)
            while not batched and not s.done:
                scheduler.step()
        while any(not s.done for s in seqs):
            scheduler.step()
        return [s.output_ids for s in seqs]

    with torch.inference_mode():
        assert run(batched=True) == run(batched=False)
        assert run(batched=True, temperature=0.8, top_p=0.9) == run(batched=False, temperature=0.8, top_p=0.9)
    loop.close()


async def test_smollm2_answers_on_cuda() -> None:
    engine = TextEngine(build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct"},
                                   engine={"device": "cuda"}))
    try:
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "What is the capital of France?"}])
        replies = await asyncio.gather(*(_text(engine, request) for _ in range(8)))
        assert all("Paris" in reply for reply in replies)
        assert engine.info().device.startswith("cuda")
    finally:
        engine.close()


async def _text(engine: TextEngine, request: ChatCompletionRequest) -> str:
    return "".join([e.text async for e in engine.chat(request, SamplingParams(max_tokens=16))])
