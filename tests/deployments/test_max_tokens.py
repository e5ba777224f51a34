"""How a request's max_tokens meets the model's context."""

from __future__ import annotations

import pytest

from rayrunner.deployments.engine import bounded_max_tokens
from rayrunner.errors import InvalidRequestError


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
