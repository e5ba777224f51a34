"""How a request's max_tokens meets the model's context, and its min_tokens."""

from __future__ import annotations

import pytest

from rayrunner.engines.base import bounded_max_tokens
from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import EngineSettings
from rayrunner.openai.sampling_params import sampling_params
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest


def test_a_reply_is_cut_where_the_context_ends() -> None:
    assert bounded_max_tokens(10, 5, 64) == 5
    assert bounded_max_tokens(10, 64, 64) == 54


def test_max_tokens_over_the_whole_context_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="context is 64") as caught:
        bounded_max_tokens(10, 65, 64)
    assert caught.value.param == "max_tokens"


def test_a_prompt_that_fills_the_context_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="64 tokens") as caught:
        bounded_max_tokens(64, 1, 64)
    assert caught.value.param == "messages"


def test_min_tokens_over_max_tokens_is_refused() -> None:
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=8, min_tokens=9)
    with pytest.raises(InvalidRequestError, match="more than max_tokens") as caught:
        sampling_params(chat, EngineSettings())
    assert caught.value.param == "min_tokens"
    unset = CompletionRequest(prompt="hi", min_tokens=EngineSettings().default_max_tokens + 1)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        sampling_params(unset, EngineSettings())
    params = sampling_params(CompletionRequest(prompt="hi", max_tokens=8, min_tokens=8, ignore_eos=True),
                             EngineSettings())
    assert (params.min_tokens, params.ignore_eos, params.skip_special_tokens) == (8, True, True)
