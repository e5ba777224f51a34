"""`JsonPrefix`: every cut of a JSON text closes into JSON that parses, whole texts need nothing, text that is no
JSON start is seen as broken, and the bytes to try next open with the closing text's."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rayrunner.openai.json_prefix import JsonPrefix

DOCS: list[Any] = [
    {"a": 1, "b": [1, -2.5e-3, 0, {"c": 'q"\\ / \u00e9 \u732b \U0001f408 \n'}], "d": None, "e": True, "f": False,
     "g": {}, "h": [], "i": [[[{"k": [None, "x"]}]]]},
    [], {}, "a string", -12, 3.0e10, True, None, [{"": ""}],
]


def _texts(doc: Any) -> list[bytes]:
    return [json.dumps(doc).encode(), json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode(),
            json.dumps(doc, ensure_ascii=False, indent=2).encode()]


def _prefix(text: bytes) -> JsonPrefix:
    prefix = JsonPrefix()
    prefix.feed(text)
    return prefix


@pytest.mark.parametrize("doc", DOCS)
def test_every_cut_closes_into_json_that_parses(doc: Any) -> None:
    for text in _texts(doc):
        for cut in range(len(text) + 1):
            prefix = _prefix(text[:cut])
            closing = prefix.closing()
            assert not prefix.broken
            json.loads((text[:cut] + closing).decode())  # cut UTF-8 characters and escapes are finished too
            assert not closing or prefix.candidates()[:1] == closing[:1]
        assert _prefix(text).complete and _prefix(text).closing() == b""


def test_fed_in_pieces_is_fed_whole() -> None:
    text = json.dumps(DOCS[0], ensure_ascii=False).encode()
    pieces = JsonPrefix()
    for start in range(0, len(text), 3):
        pieces.feed(text[start:start + 3])
        assert pieces.closing() == _prefix(text[:start + 3]).closing()


@pytest.mark.parametrize(("text", "closing"), [
    (b"", b"null"), (b'{"a": "long str', b'"}'), (b'{"a": [1, {"b": tr', b"ue}]}"), (b'{"a": 1, ', b'"_": null}'),
    (b'{"', b'_": null}'), (b'{"key"', b": null}"), (b'{"k": ', b"null}"), (b"[1, -", b"0]"), (b"[1.5e", b"0]"),
    (b'["\\', b'\\"]'), (b'["\\u00', b'00"]'), (b'["\xe7\x8c', b'\x80"]'), (b'["\xf0', b'\x90\x80\x80"]'),
])
def test_the_closing_text_is_the_shortest(text: bytes, closing: bytes) -> None:
    assert _prefix(text).closing() == closing


@pytest.mark.parametrize("text", [b"}", b'{"a" 1', b'{"a": 1}}', b"[1 2]", b"{1: 2}", b"nul!", b'{"a": 1} x'])
def test_text_that_starts_no_json_is_broken(text: bytes) -> None:
    prefix = _prefix(text)
    assert prefix.broken and not prefix.complete and prefix.closing() == b""


def test_candidates_offer_what_a_grammar_may_want_instead() -> None:
    assert _prefix(b'{"a": "x').candidates().startswith(b'"a')  # close, else go on (an enum, a minLength)
    assert b"," in _prefix(b'{"a": 1').candidates()  # a required key still to come
    assert _prefix(b'{"a": ').candidates().startswith(b'n0"')  # null, else a number, else a string
    assert _prefix(b'{"a": 1,').candidates() == b'" '  # compact JSON's space after the comma
