"""The step scheduler on real models, in-process: joining and leaving a busy batch changes no one's output,
cancelled sequences stop costing steps, the queue is bounded, long prompts are prefilled a chunk per step, and
vLLM's length settings (`ignore_eos`, `min_tokens`) hold for every choice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.transformers.step.compute_thread import ComputeThread
from rayrunner.engines.transformers.step.fast_decode import FastDecode
from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.engines.transformers.text import TextEngine
from rayrunner.errors import InvalidRequestError, ServerOverloadedError
from rayrunner.models.spec import build_spec
from rayrunner.openai import replies
from rayrunner.openai.sampling_params import SamplingParams, sampling_params
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from rayrunner.runtime.core_share import CoreShare

STORIES = [f"Write a short story about a {w}." for w in ["cat", "dog", "bird", "fish", "tree", "car", "boat", "lamp"]]


@pytest.fixture(scope="module")
def smollm2() -> TextEngine:
    torch.set_num_threads(2)
    return TextEngine(build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct"}))


@pytest.fixture(scope="module")
def smollm2_f32() -> Iterator[TextEngine]:
    """SmolLM2 in float32, for replies compared token for token. In bf16 its logits come in steps of 0.125 near 25,
    and nearly every greedy reply meets a step where the top two are one or two steps apart (the first token of the
    Paris question: 25.75 against 25.5; float32 25.36 against 25.26), so kernels that round a row differently inside
    a batch of another width can tip it; float32's margins are far wider than its rounding."""
    engine = TextEngine(build_spec("smol32", {"type": "plain", "model_id": "smollm2-135m-instruct", "dtype": "f32"}))
    yield engine
    engine.close()


def _chat(text: str) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": text}])


async def _reply(engine: TextEngine, text: str, started: asyncio.Event | None = None, **settings: Any) -> str:
    """The reply's text; `started` is set once its first token is out (or it ended without one)."""
    params = SamplingParams(**{"max_tokens": 24, **settings})
    pieces = []
    try:
        async for event in engine.chat(_chat(text), params):
            pieces.append(event.text)
            if started is not None:
                started.set()
    finally:
        if started is not None:
            started.set()
    return "".join(pieces)


async def _started(engine: TextEngine, text: str, **settings: Any) -> asyncio.Future[str]:
    """A request for `text`, once it is decoding (its first token is out)."""
    started = asyncio.Event()
    reply = asyncio.ensure_future(_reply(engine, text, started, **settings))
    await asyncio.wait_for(started.wait(), 300)
    return reply


async def _busy(engine: TextEngine, text: str, **settings: Any) -> str:
    """`text`'s reply when it joins a batch that is already decoding other requests (and others join while it
    decodes)."""
    before = await asyncio.gather(*(_started(engine, s, max_tokens=32, temperature=0.9) for s in STORIES[:4]))
    mine = await _started(engine, text, **settings)
    after = [asyncio.ensure_future(_reply(engine, s, max_tokens=8)) for s in STORIES[4:]]
    await asyncio.gather(*before, *after)
    return await mine


@pytest.mark.slow
async def test_greedy_reply_is_the_same_alone_and_inside_a_busy_batch(smollm2_f32: TextEngine) -> None:
    alone = await _reply(smollm2_f32, "What is the capital of France?")
    assert "Paris" in alone
    assert await _busy(smollm2_f32, "What is the capital of France?") == alone


@pytest.mark.slow
def test_smollm2_decodes_with_the_fast_step(smollm2: TextEngine) -> None:
    assert smollm2.scheduler.fast_decode is not None  # a Llama: `fast_decode` covers it


@pytest.mark.slow
async def test_seeded_reply_is_the_same_alone_and_batched(smollm2_f32: TextEngine) -> None:
    settings = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    alone = await _reply(smollm2_f32, "Name three colours.", **settings)
    assert await _reply(smollm2_f32, "Name three colours.", **settings) == alone
    assert await _busy(smollm2_f32, "Name three colours.", **settings) == alone


@pytest.mark.slow
async def test_a_cancelled_stream_stops_costing_steps(smollm2: TextEngine) -> None:
    stream = smollm2.chat(_chat(STORIES[0]), SamplingParams(max_tokens=2000))
    await anext(stream)
    await anext(stream)
    await stream.aclose()  # what the replica does when the client hangs up
    lease = smollm2.compute.cores.lease  # held while the step loop has work, dropped when it goes idle
    deadline = time.monotonic() + 30
    while (lease.exists() or smollm2.scheduler.stats()["running"]) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    stats = smollm2.scheduler.stats()
    assert stats["running"] == stats["waiting"] == 0 and not lease.exists()  # idle: it steps again only for new work


async def test_a_full_queue_refuses_with_429() -> None:
    engine = TextEngine(build_spec("smol", {"type": "plain", "model_id": "smollm2-135m-instruct"},
                                   engine={"max_num_seqs": 1, "max_queued_requests": 1}))
    try:
        running = engine.chat(_chat(STORIES[0]), SamplingParams(max_tokens=200))
        await anext(running)  # admitted: the one running sequence
        queued = engine.chat(_chat(STORIES[1]), SamplingParams(max_tokens=4))
        with pytest.raises(ServerOverloadedError) as caught:
            engine.chat(_chat(STORIES[2]), SamplingParams(max_tokens=4))
        assert caught.value.status == 429
        await running.aclose()
        assert [e async for e in queued][-1].finish_reason == "length"  # the queued one still runs
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("mixed", [False, True])  # True: the fast step feeds each chunk beside the decode rows
def test_a_long_prompt_is_prefilled_one_chunk_per_step(tiny_llama_dir: str, mixed: bool) -> None:
    """While a long prompt is prefilled, the running sequence still gains a token at every step."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=4, prefill_chunk_tokens=32))
    scheduler.fast_decode = FastDecode.for_model(model) if mixed else None
    loop = asyncio.new_event_loop()

    def sequence(prompt: list[int], max_tokens: int) -> Sequence:
        return Sequence(prompt, SamplingParams(max_tokens=max_tokens), Detokenizer(tokenizer, []), set(), loop)

    running, long = sequence([5, 6, 7], 100), sequence(list(range(10, 210)), 4)
    scheduler.submit(running)
    scheduler.step()
    scheduler.submit(long)
    gained = []
    while not long.output_ids:
        before = len(running.output_ids)
        scheduler.step()
        gained.append(len(running.output_ids) - before)
    assert len(gained) == -(-200 // 32)  # one chunk per step
    assert gained == [1] * len(gained)
    loop.close()


@pytest.mark.slow
@pytest.mark.parametrize("fast", [False, True])  # True: prompts joining a busy batch are fed beside its decode rows
def test_joining_and_leaving_keeps_each_sequence_exact(tiny_llama_dir: str, fast: bool) -> None:
    """Float32 tiny model: sequences joining a running batch at different steps decode exactly as alone."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    loop = asyncio.new_event_loop()
    prompts = [[1, 2, 3], list(range(20, 60)), [9] * 7, list(range(100, 113))]

    @torch.inference_mode()  # as the scheduler's loop steps
    def run(batched: bool) -> list[list[int]]:
        scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8, prefill_chunk_tokens=16))
        scheduler.fast_decode = FastDecode.for_model(model) if fast else None
        runner, mix = scheduler.runner, scheduler.runner.decode_with_prompts

        def counted(*args: Any) -> Any:
            mixed.append(batched)
            return mix(*args)

        runner.decode_with_prompts = counted  # type: ignore[method-assign]  # counts, then runs the real step
        seqs = [Sequence(p, SamplingParams(max_tokens=6 + 3 * i), Detokenizer(tokenizer, []), set(), loop)
                for i, p in enumerate(prompts)]
        for s in seqs:
            scheduler.submit(s)
            while not batched and not s.done:
                scheduler.step()
            if batched:
                scheduler.step()
        while any(not s.done for s in seqs):
            scheduler.step()
        return [s.output_ids for s in seqs]

    mixed: list[bool] = []
    assert run(batched=True) == run(batched=False)
    assert mixed == ([True] * len(mixed) if fast else []) and (len(mixed) >= 3 or not fast)  # only joiners mix
    loop.close()


@pytest.mark.slow
def test_prompts_arriving_together_start_in_one_step_beside_the_rows(tiny_llama_dir: str) -> None:
    """Short prompts arriving while a sequence decodes start together, as many as one chunk's tokens hold, fed
    beside the decode row; each decodes exactly as it does alone (float32)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    loop = asyncio.new_event_loop()
    prompts = [[1, 2, 3], list(range(20, 30)), [9] * 7, list(range(100, 113))]

    @torch.inference_mode()  # as the scheduler's loop steps
    def run(together: bool) -> list[list[int]]:
        scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8, prefill_chunk_tokens=20))
        scheduler.fast_decode = FastDecode.for_model(model)
        seqs = [Sequence(p, SamplingParams(max_tokens=8), Detokenizer(tokenizer, []), set(), loop) for p in prompts]
        for s in seqs if not together else seqs[:1]:
            scheduler.submit(s)
            while not together and not s.done:
                scheduler.step()
        if together:
            scheduler.step()
            for s in seqs[1:]:
                scheduler.submit(s)
            scheduler.step()  # 10 + 7 tokens fit one chunk of 20, the third prompt's 13 more do not
            assert [len(s.output_ids) for s in seqs] == [3, 1, 1, 0]
            scheduler.step()
            assert [len(s.output_ids) for s in seqs] == [4, 2, 2, 1]
        while any(not s.done for s in seqs):
            scheduler.step()
        return [s.output_ids for s in seqs]

    assert run(together=True) == run(together=False)
    loop.close()


@pytest.mark.slow
def test_prompts_waiting_at_an_idle_engine_start_together_from_their_cached_blocks(tiny_llama_dir: str) -> None:
    """Prompts waiting while nothing decodes, each starting with blocks in the prefix cache (a wave of streams after
    the last one ended), are fed together in one step, not the first alone; each decodes exactly as it does alone
    (float32)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    loop = asyncio.new_event_loop()
    shared = list(range(30, 62))  # two blocks
    prompts = [shared + [1, 2, 3], shared + list(range(70, 80)), shared + [9] * 7]

    @torch.inference_mode()  # as the scheduler's loop steps
    def run(together: bool) -> list[list[int]]:
        scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8))
        scheduler.fast_decode = FastDecode.for_model(model)
        seqs = [Sequence(p, SamplingParams(max_tokens=8), Detokenizer(tokenizer, []), set(), loop)
                for p in [shared + [5], *prompts]]  # the first leaves the shared blocks in the prefix cache
        for s in seqs if not together else seqs[:1]:
            scheduler.submit(s)
            while not s.done:
                scheduler.step()
        if together:
            for s in seqs[1:]:
                scheduler.submit(s)
            scheduler.step()  # the three prompts, then a decode step
            assert [(len(s.output_ids), s.cached_tokens) for s in seqs[1:]] == [(2, 32)] * 3
        while any(not s.done for s in seqs):
            scheduler.step()
        return [s.output_ids for s in seqs]

    assert run(together=True) == run(together=False)
    loop.close()


@pytest.mark.slow
def test_prompts_prefilled_aside_decode_exactly_as_alone(tiny_llama_dir: str, tmp_path: Any) -> None:
    """With a share of two cores, prompts arriving while more sequences decode are prefilled in the prefill thread
    while the decode steps go on, then join the batch; each decodes exactly as it does alone (float32)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8, 9], list(range(20, 30)), [9] * 7]
    decoding = 3  # the first three decode while the others arrive

    async def run(together: bool) -> tuple[list[list[int]], int]:
        compute = ComputeThread("test-engine")
        compute.cores = CoreShare(cores=2, folder=tmp_path)  # two cores, whatever else this node runs
        scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=8))
        scheduler.start(compute)
        loop = asyncio.get_running_loop()
        seqs = [Sequence(p, SamplingParams(max_tokens=150 if i < decoding else 8), Detokenizer(tokenizer, []),
                         set(), loop) for i, p in enumerate(prompts)]
        try:
            for s in seqs if not together else seqs[:decoding]:
                scheduler.submit(s)
                while not together and not s.done:
                    await asyncio.sleep(0.005)
            if together:
                while not all(s.output_ids for s in seqs[:decoding]):
                    await asyncio.sleep(0.005)
                for s in seqs[decoding:]:
                    scheduler.submit(s)
            while any(not s.done for s in seqs):
                await asyncio.sleep(0.005)
            return [s.output_ids for s in seqs], scheduler.stats()["prefilled_aside"]
        finally:
            scheduler.close()
            compute.shutdown()

    together, aside = asyncio.run(run(together=True))
    alone, none_aside = asyncio.run(run(together=False))
    assert together == alone
    assert aside == len(prompts) - decoding and none_aside == 0


async def _answer(engine: TextEngine, **fields: Any) -> Any:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                    **fields)
    events = engine.chat(request, sampling_params(request, engine.spec.engine))
    return await replies.chat_response("m", events, request)


@pytest.mark.slow
async def test_ignore_eos_runs_every_choice_to_max_tokens(smollm2: TextEngine) -> None:
    short = await _answer(smollm2, max_tokens=24)
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens < 16
    reply = await _answer(smollm2, max_tokens=24, ignore_eos=True, n=2, temperature=0.8, seed=3)
    assert [c.finish_reason for c in reply.choices] == ["length", "length"] and reply.usage.completion_tokens == 48
    greedy = await _answer(smollm2, max_tokens=24, ignore_eos=True)
    assert greedy.choices[0].message.content.startswith(short.choices[0].message.content)
    [paris] = smollm2.tokenizer(" Paris", add_special_tokens=False)["input_ids"]
    request = CompletionRequest(prompt="The capital of France is", max_tokens=20, ignore_eos=True, stream=True,
                                stop_token_ids=[paris])
    events = smollm2.complete(request, sampling_params(request, smollm2.spec.engine))
    chunks = [c async for c in replies.completion_chunks("m", events, request)]
    assert chunks[-1].choices[0].finish_reason == "stop"  # stop_token_ids still end it
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens < 20


@pytest.mark.slow
async def test_min_tokens_holds_back_eos_and_stop_strings(smollm2: TextEngine) -> None:
    short = (await _answer(smollm2, max_tokens=24)).choices[0].message.content
    assert "Paris" in short
    reply = await _answer(smollm2, max_tokens=40, min_tokens=20, n=2)
    assert all(c.finish_reason == "stop" or c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens >= 40  # every choice made at least 20
    assert reply.choices[0].message.content.startswith(short)
    stopped = await _answer(smollm2, max_tokens=40, stop=["Paris"], min_tokens=12)
    text = stopped.choices[0].message.content
    assert text.startswith(short[: short.index("Paris") + len("Paris")]) and stopped.usage.completion_tokens >= 12
    kept = await _answer(smollm2, max_tokens=40, stop=["Paris"], include_stop_str_in_output=True)
    assert kept.choices[0].message.content == short[: short.index("Paris") + len("Paris")]


@pytest.mark.slow
async def test_a_logit_bias_past_the_vocabulary_is_a_400_and_the_engine_keeps_serving(smollm2: TextEngine) -> None:
    vocab = smollm2.model.get_output_embeddings().weight.shape[0]
    with pytest.raises(InvalidRequestError, match=f"token id {vocab} .* {vocab} tokens") as caught:
        await _reply(smollm2, "hi", logit_bias={vocab: 5.0})
    assert caught.value.status == 400 and caught.value.param == "logit_bias"
    assert await _reply(smollm2, "hi", max_tokens=2, logit_bias={vocab - 1: 1.0})  # the last id is fine
