"""The step scheduler's model runner: carries out on tensors what the planner decided, and decides nothing.

It holds the model, the running batch's KV cache (`BatchCache`: a row per running sequence, in the scheduler's
order), the cache of the prompt being chunked, and the KV memory (`KvMemory`: the budget's measures and the prefix
cache). It prefills a group of whole prompts as one left-padded batch, or one chunk of a long prompt on its own cache
(scoring a prompt's logprobs where asked); gives each choice of a request its first token (a fork gets a copy of its
request's cache row); decodes one token for every running row (`fast_decode`'s step for the Llama family without
LoRA adapters, else the model's forward, which passes each row's adapter: `lora.LoraAdapters.forward`); samples with
each sequence's own settings (`sampling.sample`); and makes the KV moves asked of it: prefix blocks found for a
prompt or given way, a preempted row or chunk dropped, finished rows let go, a prefilled cache joining the batch, the
full blocks of a sequence's tokens left in the prefix cache. Which sequences, chunks and rows: the step scheduler's
(`scheduler.StepScheduler`), which has them from the planner (`planner`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rayrunner.engines.lora import LoraAdapters
from rayrunner.engines.transformers.kv.kv_batch import BatchCache, merged, new_cache
from rayrunner.engines.transformers.kv.kv_budget import BatchShape
from rayrunner.engines.transformers.kv.kv_memory import KvMemory, cache_bytes
from rayrunner.engines.transformers.kv.prefix_cache import BLOCK, BlockKV, cache_of
from rayrunner.engines.transformers.step.fast_decode import FastDecode, PromptChunk
from rayrunner.engines.transformers.step.sampling import Logprob, logprobs_of, sample
from rayrunner.engines.transformers.step.sequence import Sequence
from rayrunner.openai.events import TokenLogprob

Prompts = list[tuple[Sequence, int, int, BatchCache]]  # (sequence, start, end, the cache its tokens go onto)


class ModelRunner:
    """Runs `model` for one step scheduler within `memory`'s budget; `active_adapters()` names the adapters of the
    sequences admitted now (the scheduler's), which loading another adapter inside a forward must spare."""

    def __init__(self, model: Any, memory: KvMemory, adapters: LoraAdapters | None,
                 active_adapters: Callable[[], set[str]]) -> None:
        self.model = model
        self.device = model.device
        self.memory = memory
        self.adapters = adapters
        self.active_adapters = active_adapters
        self.fast_decode: FastDecode | None = None  # set by `StepScheduler.start`, on the compute thread
        self.batch: BatchCache | None = None  # the running sequences' cache
        self.chunk: BatchCache | None = None  # the cache of the prompt being chunked
        self._found: dict[int, list[BlockKV]] = {}  # by id(sequence): cached blocks its prompt starts with

    # ------------------------------------------------------------ figures for the planner

    def batch_shape(self) -> BatchShape | None:
        return None if self.batch is None else self.shape([self.batch])

    @staticmethod
    def shape(caches: list[BatchCache]) -> BatchShape:
        """`caches` as the one batch they make merged (each left-padded to the longest)."""
        if len(caches) == 1:
            cache = caches[0]
            return BatchShape(cache.rows, cache.length, cache_bytes(cache.cache), cache.room_left())
        length = max(cache.length for cache in caches)
        nbytes = sum(cache_bytes(cache.cache) * length // max(cache.length, 1) for cache in caches)
        return BatchShape(sum(cache.rows for cache in caches), length, nbytes)

    def probe(self) -> None:
        """Learn the KV budget's costs (once: forward passes of one and of two tokens)."""
        self.memory.probe(self.model)

    def find_prefixes(self, sequences: list[Sequence]) -> list[int]:
        """The tokens each of `sequences` (those that may start next) finds of its start in the prefix cache; the
        blocks found count as used now, and `start_chunk` takes them."""
        self._found.clear()
        prefix = self.memory.prefix
        if prefix is None:
            return []
        cached = []
        for sequence in sequences:
            blocks = prefix.lookup(sequence.prefill_ids, sequence.namespace) if sequence.reusable else []
            if blocks:
                self._found[id(sequence)] = blocks
            cached.append(len(blocks) * BLOCK)
        return cached

    # ------------------------------------------------------------ prefill

    def prefill_group(self, group: list[Sequence]) -> tuple[torch.Tensor, BatchCache]:
        """Prefill whole prompts the fast step does not take (`mixes`: those it takes are fed as a `Beside`) as one
        left-padded batch through transformers' forward: the logits of each one's last position, and their cache."""
        length = max(len(s.prefill_ids) for s in group)
        ids = torch.full((len(group), length), 0, dtype=torch.long, device=self.device)
        mask = torch.zeros((len(group), length), dtype=torch.long, device=self.device)
        for row, s in enumerate(group):
            ids[row, length - len(s.prefill_ids):] = torch.tensor(s.prefill_ids, device=self.device)
            mask[row, length - len(s.prefill_ids):] = 1
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = BatchCache(new_cache(self.model.config), mask)
        extra = group[0].extra_inputs if len(group) == 1 else {}
        scored = group[0].scores_prompt  # then the group is this one sequence, unpadded
        logits = self._forward(group, ids, mask, positions, cache, extra, every_position=scored)
        if scored:
            self._score_prompt(group[0], logits[0], 0)
        return logits[:, -1, :], cache

    def start_chunk(self, sequence: Sequence, start: int) -> None:
        """The cache a chunked prefill starts from (`prompt_cache`)."""
        self.chunk = self.prompt_cache(sequence, start)

    def prompt_cache(self, sequence: Sequence, start: int) -> BatchCache:
        """A cache of its own for `sequence`'s prefill: the `start` tokens' blocks found in the prefix cache, or
        none."""
        blocks = self._found.get(id(sequence)) if start else None
        if not blocks:
            empty = torch.zeros((1, 0), dtype=torch.long, device=self.device)
            return BatchCache(new_cache(self.model.config), empty)
        return BatchCache(cache_of(blocks), torch.ones((1, start), dtype=torch.long, device=self.device))

    def prefill_chunk(self, sequence: Sequence, start: int, end: int) -> tuple[torch.Tensor, BatchCache]:
        """Feed tokens `start` to `end` of `sequence`'s prefill onto its chunk cache (through the fast step for the
        prompts it takes, as their whole prefill): the last position's logits, and that cache."""
        cache = self.chunk
        if cache is None:
            raise RuntimeError("no prompt is being chunked")
        if self.mixes(sequence):  # as its whole prefill would go: a prompt's logits whichever way it starts
            return self.feed_prompts([(sequence, start, end, cache)]), cache
        chunk = sequence.prefill_ids[start:end]
        ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, device=self.device).unsqueeze(0)
        scored = sequence.scores_prompt
        logits = self._forward([sequence], ids, cache.mask_with(len(chunk)), positions, cache, every_position=scored)
        if scored:
            self._score_prompt(sequence, logits[0], start)
        sequence.prefilled = end
        return logits[:, -1, :], cache

    def first_tokens(self, group: list[Sequence], logits: torch.Tensor, caches: list[BatchCache]) -> list[Sequence]:
        """Each choice of the prefilled `group` (its rows in `caches`, one after another, its last logits) takes its
        first token (a fork gets a copy of its request's row); the choices, in the rows they now hold."""
        choices = [choice for s in group for choice in s.joining]
        if len(choices) > len(group):
            first = 0
            for cache in caches:
                cache.keep([row for row, s in enumerate(group[first: first + cache.rows]) for _ in s.joining])
                first += cache.rows
            logits = logits[[row for row, s in enumerate(group) for _ in s.joining]]
        for choice in choices:
            if choice.params.max_tokens == 0:
                choice.finish_empty()
        self.sample(choices, logits)
        return choices

    def join(self, caches: list[BatchCache]) -> None:
        """Prefilled caches join the running batch (their rows after the batch's, in order), each copied once."""
        if self.batch is None:
            self.batch = merged(caches)
        else:
            self.batch.merge(*caches)

    # ------------------------------------------------------------ decode

    def decode(self, running: list[Sequence], max_positions: int | None) -> None:
        """One token for every running sequence (a row each of the batch), the batch reserving at most
        `max_positions` per row (the budget's share)."""
        batch = self.batch
        if batch is None:
            return
        batch.max_positions = max_positions
        ids = self._last_tokens(running)
        if self.fast_decode is not None and (self.adapters is None or self.adapters.peft is None):
            logits = self.fast_decode.step(ids, batch)
        else:
            logits = self._forward(running, ids, batch.mask_with(1), batch.next_positions(), batch)
        self.sample(running, logits[:, -1, :])

    def mixes(self, sequence: Sequence) -> bool:
        """Whether the fast step takes `sequence`'s prompt, beside the next decode step's rows
        (`decode_with_prompts`) or with no rows (`prefill_aside`): a text prompt of the base model, unscored, and a
        fast step that takes prompts."""
        fast = self.fast_decode
        plain = not sequence.extra_inputs and not sequence.scores_prompt and sequence.adapter is None
        return (plain and fast is not None and fast.mixes_prompts
                and (self.adapters is None or self.adapters.peft is None))

    def decode_with_prompts(self, running: list[Sequence], max_positions: int | None,
                            prompts: Prompts) -> list[torch.Tensor]:
        """`decode`, with tokens `start` to `end` of each (sequence, start, end, cache) of `prompts` fed in the same
        forward onto that cache (its own: `prompt_cache`, or `chunk`): the logits of each one's last position
        (`mixes` said yes for each)."""
        batch, fast = self.batch, self.fast_decode
        assert batch is not None and fast is not None
        batch.max_positions = max_positions
        ids = self._last_tokens(running)
        logits = fast.step(ids, batch, _prompt_chunks(prompts, fast.heads))
        for sequence, _, end, _ in prompts:
            sequence.prefilled = end
        rows = len(running)
        self.sample(running, logits[:rows, -1, :])
        return [logits[row: row + 1, -1, :] for row in range(rows, rows + len(prompts))]

    def feed_prompts(self, prompts: Prompts) -> torch.Tensor:
        """`prefill_aside` on the step loop's thread, each sequence's `prefilled` then at its `end`."""
        logits = self.prefill_aside(prompts)
        for sequence, _, end, _ in prompts:
            sequence.prefilled = end
        return logits

    def prefill_aside(self, prompts: Prompts) -> torch.Tensor:
        """Feed tokens `start` to `end` of each (sequence, start, end, cache) of `prompts` onto that cache, with no
        decode rows: the fast step's `prefill`, which touches neither the batch nor the sequences, so it runs in the
        step scheduler's prefill thread while `decode` runs. The logits of each one's last position [prompts, vocab]."""
        fast = self.fast_decode
        assert fast is not None
        return fast.prefill(_prompt_chunks(prompts, fast.heads))[:, -1, :]

    def _last_tokens(self, running: list[Sequence]) -> torch.Tensor:
        """Each running sequence's last token [rows, 1]: what a decode step feeds."""
        return torch.tensor([[s.output_ids[-1]] for s in running], dtype=torch.long, device=self.device)

    def sample(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
        scored = [row for row, s in enumerate(sequences) if s.params.logprobs is not None]
        raw = logits[scored].float() if scored else None  # a copy: the logits stage edits `logits` in place
        tokens = sample(logits, [s.sampling_row(self.device) for s in sequences])
        found: dict[int, Logprob] = {}
        if raw is not None:
            top = max(sequences[row].params.logprobs or 0 for row in scored)
            found = dict(zip(scored, logprobs_of(raw, [tokens[row] for row in scored], top), strict=True))
        for row, (sequence, token) in enumerate(zip(sequences, tokens, strict=True)):
            if not sequence.done:
                logprob = found.get(row)
                if logprob is not None:
                    logprob.top = logprob.top[: sequence.params.logprobs]
                sequence.accept(token, logprob)

    # ------------------------------------------------------------ KV moves

    def keep_prefixes(self, rows: list[tuple[BatchCache, int, Sequence]], held_after_step: Callable[[], int]) -> None:
        """Leave the full blocks of the tokens each (cache, row, sequence) holds in the prefix cache, as far as the
        budget has room beside what the batch and a chunked prompt hold after the next step (the planner's
        `held_after_step()`) and the caches that are not the batch."""
        prefix = self.memory.prefix
        kept = [(cache, row, s) for cache, row, s in rows if s.reusable and not s.failed]
        if prefix is None or not kept:
            return
        apart = {id(cache): cache for cache, _, _ in kept if cache is not self.batch}
        held = held_after_step() + sum(cache_bytes(cache.cache) for cache in apart.values())
        for cache, row, sequence in kept:
            ids = (sequence.prompt_ids + sequence.output_ids)[: int(cache.mask[row].sum())]
            prefix.store(ids, sequence.namespace, cache.row_kv(row),
                         lambda nbytes: self.memory.make_room(held + nbytes))

    def drop_row(self, index: int) -> None:
        """A preempted sequence's row leaves the batch (its keys and values are recomputed when it runs again)."""
        if self.batch is None:
            return
        if self.batch.rows > 1:
            self.batch.keep([i for i in range(self.batch.rows) if i != index])
        else:
            self.batch = None

    def drop_chunk(self) -> None:
        """The prompt being chunked is preempted, cancelled or failed, or its cache joins the batch."""
        self.chunk = None

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only the batch's rows `keep` (the sequences still running), in that order."""
        if not keep:
            self.batch = None
        elif self.batch is not None:
            self.batch.keep(keep)

    def measure(self) -> None:
        """Record what the KV caches hold after the step (the budget's figures, as measured)."""
        self.memory.measure([c.cache for c in (self.batch, self.chunk) if c is not None])

    # ------------------------------------------------------------ the model

    def _forward(self, rows: list[Sequence], ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                 cache: BatchCache, extra: dict[str, torch.Tensor] | None = None, every_position: bool = False
                 ) -> torch.Tensor:
        """Run the model over `ids` (row i of sequence `rows[i]`, with its adapter), appending to `cache`; the
        logits [rows, positions, vocab] of each row's last position, or of every position."""
        inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "cache": cache.cache,
                  "logits_to_keep": 0 if every_position else 1, **(extra or {})}
        if self.adapters is None:
            out = self.model(**inputs)
        else:
            out = self.adapters.forward([s.adapter for s in rows], self.active_adapters(), **inputs)
        cache.grew(mask)
        return out.logits

    def _score_prompt(self, sequence: Sequence, logits: torch.Tensor, start: int) -> None:
        """Logprobs of the prompt's tokens after `start` from the logits of the positions before them."""
        targets = sequence.prompt_ids[start + 1: start + 1 + logits.shape[0]]
        found = logprobs_of(logits[: len(targets)], targets, sequence.params.logprobs or 0)
        if sequence.prompt_logprobs is None:  # the first token has nothing before it
            sequence.prompt_logprobs = [TokenLogprob(sequence.detokenizer.token_text(sequence.prompt_ids[0]), None)]
        sequence.prompt_logprobs.extend(sequence.token_logprob(f) for f in found)


def _prompt_chunks(prompts: Prompts, heads: int) -> list[PromptChunk]:
    """Tokens `start` to `end` of each (sequence, start, end, cache), fed onto that cache."""
    return [PromptChunk(sequence.prefill_ids[start:end], start, cache, heads)
            for sequence, start, end, cache in prompts]


def logits_width(model: Any) -> int:
    """How many logits a step gives: the output head's width (quantized heads keep `out_features`; padded
    vocabularies make it differ from the tokenizer's size), else the config's vocabulary."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    if width is None:
        config = model.config
        width = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    return int(width)
