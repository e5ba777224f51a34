"""One request's sequence inside the step scheduler: its prompt, settings, generated tokens and event stream.

The scheduler thread feeds it one token per step (`accept`); it detokenizes, applies stop strings, stop tokens and
`max_tokens` (`eos_ids` is empty for a request that ignores EOS), and hands events to the request's asyncio queue on
the replica's event loop. A request for n choices is one sequence with n - 1 `forks`: the scheduler prefills the
prompt once and copies its cache to every fork; all of them put their events, tagged with their `index`, on the one
queue of the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.transformers.step.sampling import Logprob, SamplingRow, logits_processors, new_generator
from rayrunner.openai.events import GenerationEvent, TokenLogprob
from rayrunner.openai.sampling_params import SamplingParams


@dataclass(eq=False)
class Sequence:
    """A request being generated. `extra_inputs` (e.g. `pixel_values`) go to the prefill forward pass only;
    `adapter` names the LoRA adapter every forward pass of it uses (None: the base model)."""

    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: Detokenizer
    eos_ids: set[int]
    loop: asyncio.AbstractEventLoop
    extra_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    adapter: str | None = None
    index: int = 0
    forks: list[Sequence] = field(default_factory=list)  # the request's other choices, sharing this prefill
    output_ids: list[int] = field(default_factory=list)
    events: asyncio.Queue[GenerationEvent | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False
    failed: bool = False  # ended by an error (its cache is not kept for reuse)
    prefilled: int = 0  # tokens of `prefill_ids` already in this sequence's cache (chunked prefill, reuse)
    cached_tokens: int = 0  # prompt tokens its first prefill took from the prefix cache
    joined: int = 0  # when it joined the running batch, in the scheduler's count (preemption takes the newest)
    started_at: float = 0.0
    first_token_at: float | None = None
    row: SamplingRow | None = None
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # of tokens whose text is not yet sent
    prompt_logprobs: list[TokenLogprob] | None = None  # sent with the first event

    def fork(self, index: int) -> Sequence:
        """Choice `index` of the same request: its own detokenizer and random stream (seed + index)."""
        params = dataclasses.replace(self.params, seed=None if self.params.seed is None else self.params.seed + index)
        return Sequence(self.prompt_ids, params, self.detokenizer.copy_empty(), self.eos_ids, self.loop,
                        index=index, events=self.events, adapter=self.adapter)

    @property
    def choices(self) -> list[Sequence]:
        return [self, *self.forks]

    @property
    def resumed(self) -> bool:
        """Preempted after generating: prefilled again from its prompt and output, as itself alone (its forks run
        on their own)."""
        return bool(self.output_ids)

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens its prefill feeds: the prompt, and for a resumed sequence its output so far too (the logits
        of the last give its next token)."""
        return self.prompt_ids + self.output_ids if self.resumed else self.prompt_ids

    @property
    def joining(self) -> list[Sequence]:
        """The choices that join the running batch once its prefill ends."""
        return [self] if self.resumed else self.choices

    @property
    def slots(self) -> int:
        """Running-sequence slots the request takes once prefilled."""
        return len(self.joining)

    @property
    def scores_prompt(self) -> bool:
        """Its prompt's tokens are scored (completions `echo` with logprobs), at its first prefill."""
        return self.params.prompt_logprobs and not self.resumed

    @property
    def namespace(self) -> tuple[str | None, str | None]:
        """What its prefix-cache blocks are shared within: its LoRA adapter and its `cache_salt`."""
        return self.adapter, self.params.cache_salt

    @property
    def reusable(self) -> bool:
        """Its prompt may be taken from, and left in, the prefix cache: text only, not scored for logprobs."""
        return not self.extra_inputs and not self.params.prompt_logprobs

    def sampling_row(self, device: torch.device) -> SamplingRow:
        if self.row is None:
            self.row = SamplingRow(self.params, self.prompt_ids, self.output_ids,
                                   logits_processors(self.params, self.eos_ids), new_generator(self.params, device))
        return self.row

    def token_logprob(self, found: Logprob) -> TokenLogprob:
        text = self.detokenizer.token_text
        return TokenLogprob(text(found.token_id), found.logprob, [(text(i), lp) for i, lp in found.top])

    @property
    def done(self) -> bool:
        return self.finished or self.cancelled

    def accept(self, token_id: int, logprob: Logprob | None = None) -> None:
        """Take the token chosen for this sequence at this step (with its logprob when the request wants them)."""
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.output_ids.append(token_id)
        if logprob is not None:
            self.pending_logprobs.append(self.token_logprob(logprob))
        if token_id in self.eos_ids or token_id in self.params.stop_token_ids:
            self._finish("stop", self.detokenizer.end_on(token_id))
            return
        text = self.detokenizer.add(token_id)
        if self.detokenizer.stopped:
            self._finish("stop", text)
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish_length(text)
        elif text:
            self.emit(self._event(text=text))

    def finish_length(self, text: str = "") -> None:
        """End with finish_reason `length`: max_tokens reached, or no KV memory left to grow into."""
        self._finish("length", text + self.detokenizer.flush())

    def finish_empty(self) -> None:
        """End without generating (max_tokens 0: a completions `echo` that only scores the prompt)."""
        self.first_token_at = time.perf_counter()
        self._finish("length", "")

    def fail(self, error: BaseException) -> None:
        self.finished = self.failed = True
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
            self._event(
                text=text,
                finish_reason=reason,
                prompt_tokens=len(self.prompt_ids),
                cached_tokens=self.cached_tokens,
                completion_tokens=len(self.output_ids),
                prompt_time_s=first - self.started_at,
                completion_time_s=end - first,
            )
        )

    def _event(self, **fields: Any) -> GenerationEvent:
        """An event of this choice, carrying the logprobs gathered since the last one (and the prompt's, once)."""
        event = GenerationEvent(index=self.index, **fields)
        if self.params.logprobs is not None:
            event.logprobs, self.pending_logprobs = self.pending_logprobs, []
        if self.prompt_logprobs is not None:
            event.prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        return event


async def events_of(sequence: Sequence) -> AsyncIterator[GenerationEvent]:
    """The events of the request's choices as the engine interface yields them; leaving early cancels them all."""
    open_choices = sequence.slots
    try:
        while open_choices:
            item = await sequence.events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            open_choices -= item.finish_reason is not None
    finally:
        for choice in sequence.choices:  # the client went away (or we finished): dropped at the next step
            choice.cancelled = True


def stop_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids that end a reply: the generation config's EOS ids and the tokenizer's."""
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids
