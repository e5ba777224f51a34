"""`Detokenizer` on the real SmolLM2 tokenizer: streamed pieces join to the text, stop strings cut it."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.models.sources import SMOLLM2, resolve


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


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_include_stop_str_keeps_the_stop_string(tokenizer: Any) -> None:
    detok = Detokenizer(tokenizer, ["Paris", "Par"], include_stop=True)
    pieces = [detok.add(i) for i in _ids(tokenizer, "The capital of France is Paris. It is large.")]
    assert detok.stopped and "".join(pieces) == "The capital of France is Paris"


def test_no_stop_string_ends_the_text_before_min_tokens(tokenizer: Any) -> None:
    ids = _ids(tokenizer, "Paris, Paris and Paris again.")
    first_stop = next(n for n in range(1, len(ids)) if "Paris" in tokenizer.decode(ids[:n]))
    detok = Detokenizer(tokenizer, ["Paris"], min_tokens=first_stop)
    pieces = []
    for token_id in ids:
        pieces.append(detok.add(token_id))
        if detok.stopped:
            break
    assert detok.stopped and "".join(pieces) == "Paris, "  # the first Paris came too early, the second stops


def test_a_stop_token_ends_the_text_without_losing_a_held_back_tail(tokenizer: Any) -> None:
    """The stop token's own text is left out (vLLM's rule) but the text held back before it is not."""
    detok = Detokenizer(tokenizer, ["Paris"])
    pieces = [detok.add(i) for i in _ids(tokenizer, "Hello Pa")]
    period = _ids(tokenizer, ".")[0]
    assert "".join(pieces) + detok.end_on(period) == "Hello Pa"
    kept = Detokenizer(tokenizer, ["Paris"], include_stop=True)
    pieces = [kept.add(i) for i in _ids(tokenizer, "Hello Pa")]
    assert "".join(pieces) + kept.end_on(period) == "Hello Pa."


def test_special_tokens_are_skipped_unless_asked_for(tokenizer: Any) -> None:
    ids = _ids(tokenizer, "<|im_start|>assistant\nHi<|im_end|>")
    skipped, kept = Detokenizer(tokenizer, []), Detokenizer(tokenizer, [], dropped=frozenset())
    assert "".join(skipped.add(i) for i in ids) + skipped.flush() == "assistant\nHi"
    assert "".join(kept.add(i) for i in ids) + kept.flush() == "<|im_start|>assistant\nHi<|im_end|>"


def test_a_long_reply_streams_exactly_its_full_decode(tokenizer: Any) -> None:
    """Each token decodes a short window: the pieces still join to the decode of all the ids, for text with
    multi-token characters and for arbitrary ids (invalid byte runs included)."""
    import random

    text = "日本語のテキスト, Ünïcödé, emojis 🐉🎉👩‍👩‍👧, code: def f(x):\n    return x**2  # ok\n" * 8
    pieces, _ = stream(tokenizer, text, [])
    assert "".join(pieces) == text
    draw = random.Random(7)
    for _ in range(50):
        ids = [draw.randrange(len(tokenizer)) for _ in range(40)]
        detok = Detokenizer(tokenizer, [])
        streamed = "".join(detok.add(token_id) for token_id in ids) + detok.flush()
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True)
