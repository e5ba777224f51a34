"""Incremental detokenization with stop strings, for one generated sequence.

Streams only text that is final: an incomplete UTF-8 character, or a tail that might still grow into a stop
string, is held back until later text decides it. So the streamed pieces always join to the full text.
`StopFilter` does the stop-string part on any stream of text; `Detokenizer` feeds it from token ids, with vLLM's
settings: `min_tokens` (no stop string ends the text before then), `include_stop_str_in_output` and
`skip_special_tokens`. Special tokens are skipped by the tokenizer's own decode unless some must stay: all of them
(`skip_special_tokens` false), or the tool-call markers a reply's parser looks for (Mistral's `[TOOL_CALLS]`,
Llama's `<|python_tag|>`), in which case the other special ids are dropped as they arrive.

Each token decodes a short window, not the whole reply (which made a long reply's cost grow with its square): the
tokens of the last emitted piece and those after it, the new text being what that window adds to the decode of
the piece alone (the offsets vLLM and TGI keep, so that a token's leading space or a multi-token character comes
out as in the full decode).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rayrunner.openai.sampling_params import SamplingParams


class StopFilter:
    """Cuts streamed text at the first stop string (after it, with `include`), holding back any tail that may be
    the start of one."""

    def __init__(self, stops: list[str], include: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include = include
        self.pending = ""
        self.stopped = False

    def push(self, text: str, armed: bool = True) -> str:
        """The part of `text` that is safe to send now; stop strings only end the text while `armed`."""
        self.pending += text
        hits = [(i, -len(s)) for s in self.stops if armed and (i := self.pending.find(s)) >= 0]
        if hits:
            self.stopped = True
            start, minus_length = min(hits)  # the earliest stop string, the longest of those starting there
            ready, self.pending = self.pending[: start - minus_length if self.include else start], ""
            return ready
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - keep
        ready, self.pending = self.pending[:cut], self.pending[cut:]
        return ready

    def flush(self) -> str:
        """What is still held back once generation has ended (it turned out not to be a stop string)."""
        ready, self.pending = self.pending, ""
        return ready


def special_ids(tokenizer: Any, tokens: Iterable[str] | None = None) -> frozenset[int]:
    """The ids of the tokenizer's special tokens (those its decode skips), or of those among `tokens`."""
    specials = {token.content: i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(specials.values() if tokens is None else (specials[t] for t in tokens if t in specials))


class Detokenizer:
    """`dropped`: None lets the tokenizer skip every special token; a set keeps special tokens in the text except
    those ids (empty: keep them all)."""

    def __init__(self, tokenizer: Any, stop: list[str], include_stop: bool = False, min_tokens: int = 0,
                 dropped: frozenset[int] | None = None) -> None:
        self._tokenizer = tokenizer
        self._stops = StopFilter(stop, include_stop)
        self._min_tokens = min_tokens
        self._unarmed = min_tokens  # tokens still to come before a stop string may end the text
        self._dropped = dropped
        self._ids: list[int] = []
        self._prefix_at = 0  # the window's start: the first token of the last piece emitted
        self._read_at = 0  # the first token not yet emitted

    @classmethod
    def of(cls, tokenizer: Any, params: SamplingParams, kept: frozenset[int] = frozenset()) -> Detokenizer:
        """A request's detokenizer. `kept`: special token ids that stay in the text even while special tokens are
        skipped (the tool-call markers its reply's parser reads)."""
        dropped: frozenset[int] | None = None
        if not params.skip_special_tokens:
            dropped = frozenset()
        elif kept:
            dropped = special_ids(tokenizer) - kept
        return cls(tokenizer, params.stop, params.include_stop_str_in_output, params.min_tokens, dropped)

    def copy_empty(self) -> Detokenizer:
        """A fresh detokenizer with the same tokenizer and settings (for another choice of the request)."""
        return Detokenizer(self._tokenizer, self._stops.stops, self._stops.include, self._min_tokens, self._dropped)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (for logprobs)."""
        return str(self._tokenizer.decode([token_id]))

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def add(self, token_id: int) -> str:
        """Take one token; return the newly final text (may be empty). Sets `stopped` on a stop string."""
        armed = not self._unarmed
        if not armed:
            self._unarmed -= 1
        if self._dropped is not None and token_id in self._dropped:
            return ""
        self._ids.append(token_id)
        return self._pass(self._new_text(final=False), armed)

    def end_on(self, token_id: int) -> str:
        """The rest of the text when `token_id` (EOS or a stop token id) ends the sequence: the token's own text is
        part of it only with `include_stop`."""
        return (self.add(token_id) if self._stops.include else "") + self.flush()

    def flush(self) -> str:
        """Everything not yet emitted (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        return self._pass(self._new_text(final=True), not self._unarmed) + self._stops.flush()

    def _new_text(self, final: bool) -> str:
        """The text the tokens after the last piece add; held (empty) while it ends in an incomplete character
        (U+FFFD until a multi-token character's last byte arrives), unless the sequence is over (`final`)."""
        window = self._decode(self._ids[self._prefix_at :])
        known = self._decode(self._ids[self._prefix_at : self._read_at])
        if len(window) <= len(known) or (window.endswith("\ufffd") and not final):
            return ""
        self._prefix_at, self._read_at = self._read_at, len(self._ids)
        return window[len(known) :]

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._dropped is None)) if ids else ""

    def _pass(self, piece: str, armed: bool) -> str:
        if self.stopped or not piece:
            return ""
        return self._stops.push(piece, armed)
