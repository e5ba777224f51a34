"""n choices from one prefill, logprobs of generated and prompt tokens, against a plain forward pass of the model."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rayrunner.engines.transformers.text import TextEngine
from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import build_spec
from rayrunner.openai import replies
from rayrunner.openai.sampling_params import sampling_params
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.slow  # every test loads SmolLM2
QUESTION = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def smollm2() -> TextEngine:
    """float32, so a plain forward pass and the scheduler's cached steps agree to rounding."""
    return TextEngine(build_spec("smol32", {"type": "plain", "model_id": "smollm2-135m-instruct", "dtype": "f32"}))


async def _chat(engine: TextEngine, **fields: Any) -> Any:
    request = ChatCompletionRequest(messages=QUESTION, **fields)
    return await replies.chat_response("m", engine.chat(request, sampling_params(request, engine.spec.engine)),
                                         request)


def _plain_logprobs(engine: TextEngine, ids: list[int]) -> torch.Tensor:
    """log-softmax at every position of one forward pass over `ids` (position i scores token i + 1)."""
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


async def test_greedy_logprobs_match_a_plain_forward_pass(smollm2: TextEngine) -> None:
    reply = await _chat(smollm2, max_tokens=8, logprobs=True, top_logprobs=5)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 8
    assert "".join(e.token for e in entries) == reply.choices[0].message.content
    prompt = smollm2.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = smollm2.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    output_ids = smollm2.tokenizer(reply.choices[0].message.content, add_special_tokens=False)["input_ids"]
    plain = _plain_logprobs(smollm2, prompt_ids + output_ids)
    for step, (entry, token) in enumerate(zip(entries, output_ids, strict=True)):
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the most likely
        assert len(entry.top_logprobs) == 5
        assert entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(plain[len(prompt_ids) + step - 1, token])) < 1e-3


async def test_echo_scores_the_prompt_like_a_plain_forward_pass(smollm2: TextEngine) -> None:
    request = CompletionRequest(prompt="The capital of France is Paris", max_tokens=0, echo=True, logprobs=2)
    events = smollm2.complete(request, sampling_params(request, smollm2.spec.engine))
    choice = (await replies.completion_response("m", events, request)).choices[0]
    ids = smollm2.tokenizer("The capital of France is Paris")["input_ids"]
    plain = _plain_logprobs(smollm2, ids)
    assert choice.text == "The capital of France is Paris"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs[0] is None
    scored = choice.logprobs.token_logprobs[1:]
    assert len(scored) == len(ids) - 1
    for position, logprob in enumerate(scored):
        assert logprob is not None and abs(logprob - float(plain[position, ids[position + 1]])) < 1e-3
    assert choice.logprobs.text_offset[:2] == [0, len(choice.logprobs.tokens[0])]


async def test_n_choices_share_one_prefill_and_each_follows_its_own_seed(smollm2: TextEngine) -> None:
    steps = smollm2.scheduler.steps
    reply = await _chat(smollm2, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert smollm2.scheduler.steps - steps <= 12  # one prefill step shared, then one decode step per token
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert 3 <= reply.usage.completion_tokens <= 36
    texts = [c.message.content for c in reply.choices]
    assert len(set(texts)) == 3  # seeds 7, 8 and 9
    again = await _chat(smollm2, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == texts


async def test_greedy_choices_all_give_the_greedy_reply(smollm2: TextEngine) -> None:
    alone = (await _chat(smollm2, max_tokens=10)).choices[0].message.content
    assert [c.message.content for c in (await _chat(smollm2, max_tokens=10, n=3)).choices] == [alone] * 3


async def test_streamed_choices_interleave_by_index_and_usage_comes_last(smollm2: TextEngine) -> None:
    request = ChatCompletionRequest(messages=QUESTION, max_tokens=6, n=2, stream=True,
                                    stream_options={"include_usage": True})
    chunks = [c async for c in replies.chat_chunks(
        "m", smollm2.chat(request, sampling_params(request, smollm2.spec.engine)), request)]
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        assert len(chunk.choices) == 1 and chunk.usage is None
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert texts[0] == texts[1] != ""  # greedy: both choices take the same path


async def test_more_choices_than_the_model_runs_at_once_is_a_400() -> None:
    engine = TextEngine(build_spec("smol2", {"type": "plain", "model_id": "smollm2-135m-instruct"},
                                   engine={"max_num_seqs": 2}))
    try:
        with pytest.raises(InvalidRequestError, match="n is 3"):
            await _chat(engine, max_tokens=4, n=3)
    finally:
        engine.close()
