"""`Detokenizer` on the real SmolLM2 tokenizer: streamed pieces join to the text, stop strings cut it."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from rayrunner.deployments.detokenizer import Detokenizer
from rayrunner.sources import SMOLLM2, resolve


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)


def stream(tokenizer: Any, text: str, stop: list[str]) -> tuple[list[str], Detokenizer]:
    detok = Detokenizer(tokenizer, stop)
    pieces = []
    for token_id in tokenizer(text, add_special_tokens=False)["input_ids"]:
        pieces.append(detok.add(token_id))
        if detok.stopped:
            break
    pieces.append(detok.flush())
    return pieces, detok


def test_pieces_join_to_the_text_and_never_hold_a_broken_character(tokenizer: Any) -> None:
    text = "Café au lait 🐉 costs 3€ in Paris."
    pieces, detok = stream(tokenizer, text, [])
    assert "".join(pieces) == text and not detok.stopped
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_stop_string_split_across_tokens_cuts_the_text_before_it(tokenizer: Any) -> None:
    pieces, detok = stream(tokenizer, "The capital of France is Paris. It is large.", ["Paris"])
    assert detok.stopped
    assert "".join(pieces) == "The capital of France is "
    assert all("Par" not in piece for piece in pieces)


def test_a_held_back_prefix_is_released_when_no_stop_follows(tokenizer: Any) -> None:
    pieces, detok = stream(tokenizer, "Pa is not Paul.", ["Paris"])
    assert not detok.stopped and "".join(pieces) == "Pa is not Paul."
