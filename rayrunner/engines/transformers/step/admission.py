"""Which waiting sequences start at the next step: the scheduler's admission policy, apart from its execution.

A step prefills either one group of whole prompts, left-padded into one batch, or one chunk of a long prompt. The
group is taken from the head of the queue, in order, while it fits the free sequence slots, the chunk's token
budget (its longest prompt times its size) and the KV memory budget (`fits`, the planner's); a prompt that needs a
pass of its own (images, prompt logprobs, a prompt longer than one chunk, one that starts from cached prefix blocks)
goes alone; a sequence for a LoRA adapter waits while `max_adapters` others are in use. Whole text prompts the
fast step takes (cached blocks or not) are instead fed beside the decode step, or together when no rows decode,
several at once within one chunk's tokens (`beside`). Pure logic over the sequences' sizes: tested without a model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar


class Waiting(Protocol):
    """What admission reads of a sequence (read only)."""

    @property
    def extra_inputs(self) -> dict[str, Any]: ...  # images and the like: prefilled in one pass

    @property
    def adapter(self) -> str | None: ...  # its LoRA adapter (None: the base model)

    @property
    def prefilled(self) -> int: ...  # tokens of `prefill_ids` its cache starts with (prefix blocks found in the cache)

    @property
    def prefill_ids(self) -> list[int]: ...  # the tokens its prefill feeds

    @property
    def slots(self) -> int: ...  # sequence slots it holds once running (1 + its forks)

    @property
    def scores_prompt(self) -> bool: ...  # its prompt's logprobs are scored, in a pass of its own


W = TypeVar("W", bound=Waiting)


class Admission:
    """The admission policy of one scheduler: `chunk_tokens` per prefill pass, at most `max_adapters` LoRA adapters
    in use (None: no adapters), every prompt whole in a pass of its own when `one_per_pass` (recurrent models: left
    padding would run through their states, and not every model's layers continue a state over several tokens:
    Jamba's do not)."""

    def __init__(self, chunk_tokens: int, max_adapters: int | None = None, one_per_pass: bool = False) -> None:
        self.chunk_tokens = chunk_tokens
        self.max_adapters = max_adapters
        self.one_per_pass = one_per_pass

    def group(self, waiting: Sequence[Waiting], running: Iterable[Waiting], free_slots: int,
              fits: Callable[[list[Any]], bool] = lambda group: True) -> int:
        """How many sequences from the head of `waiting` start prefilling together now; `fits(group)` says whether
        the KV memory budget has room for a group."""
        taken: list[Waiting] = []
        in_use: set[str] = {s.adapter for s in running if s.adapter is not None}
        for candidate in waiting:
            if sum(s.slots for s in taken) + candidate.slots > free_slots:
                break
            alone = self.alone(candidate)
            longest = max([len(s.prefill_ids) for s in taken] + [len(candidate.prefill_ids)])
            if taken and (alone or self.alone(taken[0]) or longest * (len(taken) + 1) > self.chunk_tokens):
                break
            if not self._adapter_room(candidate, in_use | {s.adapter for s in taken if s.adapter is not None}):
                break
            if not fits([*taken, candidate]):
                break
            taken.append(candidate)
            if alone:
                break
        return len(taken)

    def beside(self, waiting: Sequence[W], free_slots: int, fits: Callable[[list[W]], bool],
               mixes: Callable[[W], bool]) -> int:
        """How many sequences from the head of `waiting` are fed whole beside the next decode step, or together when
        none decodes (`mixes` says which can be: text prompts of the base model), each from the tokens its start
        finds cached, their new tokens together within one chunk, within the free slots and the KV budget
        (`fits`)."""
        taken: list[W] = []
        tokens = 0
        for candidate in waiting:
            tokens += len(candidate.prefill_ids) - candidate.prefilled
            if (tokens > self.chunk_tokens or sum(s.slots for s in taken) + candidate.slots > free_slots
                    or self.one_per_pass or not mixes(candidate) or not fits([*taken, candidate])):
                break
            taken.append(candidate)
        return len(taken)

    def alone(self, sequence: Waiting) -> bool:
        """Prefilled in a pass of its own: images, a prompt scored for logprobs, a prompt of several chunks, or one
        whose cache starts with cached blocks."""
        return self.one_per_pass or bool(sequence.extra_inputs) or sequence.scores_prompt or self.chunked(sequence)

    def chunked(self, sequence: Waiting) -> bool:
        """Prefilled on a cache of its own, one chunk per step: a text prompt longer than one chunk, or one that
        starts from cached blocks (images need one pass)."""
        to_prefill = len(sequence.prefill_ids) - sequence.prefilled
        whole = bool(sequence.extra_inputs) or self.one_per_pass
        return not whole and (to_prefill > self.chunk_tokens or sequence.prefilled > 0)

    def _adapter_room(self, candidate: Waiting, in_use: set[str]) -> bool:
        if self.max_adapters is None or candidate.adapter is None:
            return True
        return candidate.adapter in in_use or len(in_use) < self.max_adapters
