"""One request's sequence inside the step scheduler: its prompt, settings, generated tokens and event stream.

The scheduler thread feeds it one token per step (`accept`); it detokenizes, applies stop strings, stop tokens and
`max_tokens`, and hands events to the request's asyncio queue on the replica's event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rayrunner.deployments.detokenizer import Detokenizer
from rayrunner.deployments.engine import GenerationEvent
from rayrunner.deployments.sampling import SamplingParams, SamplingRow, new_generator


@dataclass(eq=False)
class Sequence:
    """A request being generated. `extra_inputs` (e.g. `pixel_values`) go to the prefill forward pass only."""

    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    eos_ids: set[int]
    loop: asyncio.AbstractEventLoop
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)
    events: asyncio.Queue[GenerationEvent | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False
    prefilled: int = 0  # prompt tokens already in this sequence's cache (chunked prefill)
    started_at: float = 0.0
    first_token_at: float | None = None
    row: SamplingRow | None = None

    def sampling_row(self, device: torch.device) -> SamplingRow:
        if self.row is None:
            self.row = SamplingRow(self.params, self.prompt_ids, self.output_ids, self.params.processors(),
                                   new_generator(self.params, device))
        return self.row

    @property
    def done(self) -> bool:
        return self.finished or self.cancelled

    def accept(self, token_id: int) -> None:
        """Take the token chosen for this sequence at this step."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.output_ids.append(token_id)
        if token_id in self.eos_ids or token_id in self.params.stop_token_ids:
            self.detokenizer.add(token_id)
            self._finish("stop", self.detokenizer.flush())
            return
        text = self.detokenizer.add(token_id)
        if self.detokenizer.stopped:
            self._finish("stop", text)
        elif len(self.output_ids) >= self.params.max_tokens:
            self._finish("length", text + self.detokenizer.flush())
        elif text:
            self.emit(GenerationEvent(text=text))

    def fail(self, error: BaseException) -> None:
        self.finished = True
        self.emit(error)

    def emit(self, item: GenerationEvent | BaseException) -> None:
        """Thread-safe: hand an event (or the error that ended the sequence) to the waiting request."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the replica's event loop is gone: nobody is listening any more
            self.cancelled = True

    def _finish(self, reason: str, text: str) -> None:
        self.finished = True
        end = time.perf_counter()
        first = self.first_token_at or end
        self.emit(
            GenerationEvent(
                text=text,
                finish_reason=reason,
                prompt_tokens=len(self.prompt_ids),
                completion_tokens=len(self.output_ids),
                prompt_time_s=first - self.started_at,
                completion_time_s=end - first,
            )
        )


async def events_of(sequence: Sequence) -> AsyncIterator[GenerationEvent]:
    """The sequence's events as the engine interface yields them; leaving early cancels the sequence."""
    try:
        while True:
            item = await sequence.events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        sequence.cancelled = True  # the client went away (or we finished): the scheduler drops it at its next step


def stop_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids that end a reply: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids
