"""Incremental detokenization with stop strings, for one generated sequence.

Streams only text that is final: an incomplete UTF-8 character, or a tail that might still grow into a stop
string, is held back until the next token decides it. So the streamed pieces always join to the full text.
"""

from __future__ import annotations

from typing import Any


class Detokenizer:
    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self._emitted = 0
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def add(self, token_id: int) -> str:
        """Take one token; return the newly final text (may be empty). Sets `stopped` on a stop string."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        cut = self._stop_index(text)
        if cut is not None:
            self.stopped = True
            return self._take(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._take(text[: len(text) - self._pending_stop_prefix(text)])

    def flush(self) -> str:
        """Everything not yet emitted (the sequence ended without a stop string)."""
        if self.stopped:
            return ""
        return self._take(self._tokenizer.decode(self._ids, skip_special_tokens=True))

    def _take(self, final: str) -> str:
        if len(final) <= self._emitted:
            return ""
        piece = final[self._emitted :]
        self._emitted = len(final)
        return piece

    def _stop_index(self, text: str) -> int | None:
        # Search only where a new match can start: stop strings already ruled out stay ruled out.
        longest = max((len(s) for s in self._stop), default=0)
        start = max(0, self._emitted - longest)
        found = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
        return min(found) if found else None

    def _pending_stop_prefix(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:size]):
                    best = size
                    break
        return best
