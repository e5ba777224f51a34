"""Incremental detokenization with stop strings, for one generated sequence.

Streams only text that is final: an incomplete UTF-8 character, or a tail that might still grow into a stop
string, is held back until later text decides it. So the streamed pieces always join to the full text.
`StopFilter` does the stop-string part on any stream of text (the multimodal engine uses it on decoded text
directly); `Detokenizer` feeds it from token ids.
"""

from __future__ import annotations

from typing import Any


class StopFilter:
    """Cuts streamed text at the first stop string, holding back any tail that may be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, text: str) -> str:
        """The part of `text` that is safe to send now."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            ready, self.pending = self.pending[: min(hits)], ""
            return ready
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.pending.endswith(s[:n])), default=0)
        cut = len(self.pending) - keep
        ready, self.pending = self.pending[:cut], self.pending[cut:]
        return ready

    def flush(self) -> str:
        """What is still held back once generation has ended (it turned out not to be a stop string)."""
        ready, self.pending = self.pending, ""
        return ready


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = StopFilter(stop)
        self._ids: list[int] = []
        self._passed = 0  # characters of the decoded text already handed to the stop filter

    def copy_empty(self) -> Detokenizer:
        """A fresh detokenizer with the same tokenizer and stop strings (for another choice of the request)."""
        return Detokenizer(self._tokenizer, self._stops.stops)

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens included (for logprobs)."""
        return str(self._tokenizer.decode([token_id]))

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    def add(self, token_id: int) -> str:
        """Take one token; return the newly final text (may be empty). Sets `stopped` on a stop string."""
        self._ids.append(token_id)
        # A character whose bytes span several tokens decodes to U+FFFD until its last byte arrives.
        return self._pass(self._decode().rstrip("\ufffd"))

    def flush(self) -> str:
        """Everything not yet emitted (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        return self._pass(self._decode()) + self._stops.flush()

    def _decode(self) -> str:
        return str(self._tokenizer.decode(self._ids, skip_special_tokens=True))

    def _pass(self, text: str) -> str:
        if self.stopped or len(text) <= self._passed:
            return ""
        piece, self._passed = text[self._passed :], len(text)
        return self._stops.push(piece)
