"""The step scheduler: iteration-level batching of one model's sequences, in a worker thread of the replica.

Every step it
1. drops cancelled sequences (a client that hung up stops costing work at once),
2. admits waiting sequences while fewer than `max_num_seqs` run and the KV budget has room (`kv_moves`), and
   prefills at most one chunk's worth of prompt tokens: several short prompts as one padded batch, or the next
   `prefill_chunk_tokens` of one long prompt or of one whose start is in the prefix cache, so running streams wait
   at most one chunk per step (a request for a LoRA adapter waits while `max_adapters` other adapters are in use),
3. decodes one token for every running sequence in one forward pass over the shared `BatchCache` (`fast_decode`'s
   step for the Llama family without LoRA adapters, else the model's forward), with each sequence's own sampling
   settings (`sampling.sample`), after making room for the step in the KV budget (preempting the newest sequences
   if it must), and retires the ones that finished (their blocks go to the prefix cache).
Sequences join and leave between steps without recomputing anyone else's cache. Past `max_queued_requests` waiting
sequences, `submit` refuses with `ServerOverloadedError` (HTTP 429). The loop runs on the engine's `ComputeThread`,
the thread that loaded the model (`compute_thread` says why one thread does all the work). With LoRA adapters, every
forward passes each row's adapter (`lora.LoraAdapters.forward`), so one batch mixes adapters and the base model;
adapters are loaded between steps (`between_steps`) or when a sequence first needs one.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.lora import LoraAdapters
from rayrunner.engines.transformers.kv.kv_batch import BatchCache, mergeable, new_cache, plain_attention, recurrent
from rayrunner.engines.transformers.kv.kv_memory import KvMemory
from rayrunner.engines.transformers.kv.prefix_cache import LayerKV
from rayrunner.engines.transformers.step.admission import Admission
from rayrunner.engines.transformers.step.compute_thread import ComputeThread
from rayrunner.engines.transformers.step.fast_decode import FastDecode
from rayrunner.engines.transformers.step.kv_moves import KvMoves
from rayrunner.engines.transformers.step.sampling import Logprob, logprobs_of, sample
from rayrunner.engines.transformers.step.sequence import Sequence, events_of
from rayrunner.errors import InvalidRequestError, ServerOverloadedError
from rayrunner.models.spec import EngineSettings
from rayrunner.openai.events import GenerationEvent, TokenLogprob
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.runtime import metrics

logger = logging.getLogger(__name__)
_REPORT_S = 0.5  # the running/queued gauges' refresh while busy
STUCK_STEP_S = 300.0  # one step (a prefill chunk and a decode) taking longer than this means the engine is wedged
T = TypeVar("T")


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 32
    max_queued_requests: int = 256
    prefill_chunk_tokens: int = 512
    kv_cache_bytes: int | None = None  # None: `kv_memory`'s default for the device
    prefix_caching: bool = True
    gpu_share: float = 0.0  # of its GPU this replica reserved (`engine.num_gpus`): the default budget's part of it


def scheduler_limits(settings: EngineSettings) -> SchedulerLimits:
    return SchedulerLimits(settings.max_num_seqs, settings.max_queued_requests, settings.prefill_chunk_tokens,
                           settings.kv_cache_bytes, settings.prefix_caching, settings.num_gpus)


class StepScheduler(KvMoves):
    """Runs one model's sequences step by step in a daemon thread; `submit` may be called from any thread."""

    def __init__(self, model: Any, limits: SchedulerLimits, adapters: LoraAdapters | None = None,
                 model_id: str | None = None) -> None:
        """`model_id` labels the running/queued gauges this scheduler reports (`rayrunner.runtime.metrics`);
        None: none."""
        self.model = model
        self.model_id = model_id
        self.adapters = adapters
        self.fast_decode: FastDecode | None = None  # set by `start`, on the compute thread
        self.device = model.device
        self.vocab_size = _logits_width(model)
        self.limits = limits
        shared = mergeable(model.config)
        self.max_running = limits.max_num_seqs if shared else 1
        if not shared:
            logger.warning("this model's KV cache cannot be shared by several sequences: one runs at a time")
        states = recurrent(model.config)
        self.admission = Admission(limits.prefill_chunk_tokens, adapters.max_adapters if adapters else None,
                                   one_per_pass=states)
        reuse = limits.prefix_caching and plain_attention(model.config)  # the prefix cache's blocks are plain layers
        self.memory = KvMemory(limits.kv_cache_bytes, self.device, reuse, limits.gpu_share)
        self._found: dict[int, list[LayerKV]] = {}  # by id(sequence): cached blocks its prompt starts with
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._batch: BatchCache | None = None
        self._chunking: tuple[Sequence, BatchCache] | None = None  # a long prompt being prefilled chunk by chunk
        self._prefilling: list[Sequence] = []  # taken from the queue, not yet running
        self._jobs: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()
        self._closed = False
        self._loop_done: Future[None] | None = None
        self._step_started_at: float | None = None  # while a step runs (health checks spot a stuck one)
        self._died_of: BaseException | None = None
        self._reported_at = 0.0
        self.steps = 0

    # ------------------------------------------------------------ the request side

    def submit(self, sequence: Sequence) -> None:
        with self._cond:
            if len(self._waiting) >= self.limits.max_queued_requests + self._free_slots():
                raise ServerOverloadedError(
                    f"the model's queue is full ({self.limits.max_queued_requests} requests waiting); retry shortly"
                )
            self._waiting.append(sequence)
            self._cond.notify()

    def generate(self, prompt_ids: list[int], params: SamplingParams, detokenizer: Detokenizer, eos_ids: set[int],
                 extra_inputs: dict[str, torch.Tensor] | None = None, adapter: str | None = None
                 ) -> AsyncIterator[GenerationEvent]:
        """Queue a request's sequence, with a fork per extra choice (from the replica's event loop); its events.
        `adapter` names the LoRA adapter the request runs with (None: the base model); `eos_ids` end its replies
        unless it ignores EOS."""
        if params.n > self.max_running:
            raise InvalidRequestError(f"n is {params.n}; this model runs at most {self.max_running} sequences at once",
                                      param="n")
        past = [token for token in params.logit_bias if token >= self.vocab_size]
        if past:  # checked here: inside a step it would fail every sequence of the batch
            raise InvalidRequestError(f"logit_bias: token id {min(past)} is past this model's vocabulary of "
                                      f"{self.vocab_size} tokens", param="logit_bias")
        sequence = Sequence(prompt_ids, params, detokenizer, set() if params.ignore_eos else eos_ids,
                            asyncio.get_running_loop(),
                            extra_inputs=extra_inputs or {}, adapter=adapter)
        sequence.forks = [sequence.fork(i) for i in range(1, params.n)]
        self.submit(sequence)
        return events_of(sequence)

    def stats(self) -> dict[str, int]:
        memory = self.memory
        with self._cond:
            return {"running": self.max_running - self._free_slots(), "waiting": len(self._waiting),
                    "steps": self.steps, "max_num_seqs": self.max_running,
                    "max_queued_requests": self.limits.max_queued_requests,
                    "kv_cache_bytes": memory.held, "kv_cache_budget_bytes": memory.limit,
                    "kv_cache_peak_bytes": memory.peak, "prefix_cache_bytes": memory.prefix.nbytes if memory.prefix
                    else 0, "preemptions": memory.preemptions}

    def _free_slots(self) -> int:
        """Sequence slots no admitted sequence holds (call with the lock held)."""
        held = len(self._running) + sum(s.slots for s in self._prefilling)
        return self.max_running - held - (self._chunking[0].slots if self._chunking is not None else 0)

    def between_steps(self, fn: Callable[[], T]) -> Future[T]:
        """Run `fn` on the scheduler's thread before its next step (e.g. loading an adapter into the model)."""
        future: Future[T] = Future()
        with self._cond:
            self._jobs.append((fn, future))
            self._cond.notify()
        return future

    def active_adapters(self) -> set[str]:
        """Adapters of the admitted sequences, which eviction must spare (call on the scheduler thread)."""
        with self._cond:
            admitted = self._admitted()
        return {s.adapter for s in admitted if s.adapter is not None}

    def _admitted(self) -> list[Sequence]:
        """Running, being prefilled, or being chunked (call with the lock held)."""
        return [*self._running, *self._prefilling, *([self._chunking[0]] if self._chunking else [])]

    def start(self, compute: ComputeThread) -> None:
        """Run steps on `compute` whenever there is work (tests may instead call `step` themselves). The fast decode
        step is made there too: it concatenates weights, and a torch op in another thread slows every later one
        (`compute_thread`)."""
        self.fast_decode = compute.call(FastDecode.for_model, self.model)
        self._loop_done = compute.submit(self._loop, compute)

    def check_health(self) -> None:
        """Raise when the step loop has died, or one step has run past `STUCK_STEP_S` (Serve then replaces the
        replica: its requests would otherwise hang)."""
        if self._died_of is not None:
            raise RuntimeError(f"the step loop has stopped: {self._died_of!r}")
        started = self._step_started_at
        if started is not None and time.monotonic() - started > STUCK_STEP_S:
            raise RuntimeError(f"one step has been running for {time.monotonic() - started:.0f} s: the engine is stuck")

    def close(self) -> None:
        """Stop the loop after its current step, and wait for it: the loop never outlives the engine's owner (a
        thread still dropping tensors while the interpreter exits aborts the process). Once the interpreter is
        finalizing, its daemon threads no longer run: nothing to wait for."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._loop_done is not None and not sys.is_finalizing():
            self._loop_done.result(timeout=30)

    # ------------------------------------------------------------ the scheduler thread

    def _loop(self, compute: ComputeThread) -> None:
        try:
            self._steps(compute)
        except BaseException as exc:  # a fault outside a model call: nothing can be served any more
            logger.exception("the step loop died")
            self._died_of = exc  # before failing the requests: a health check right after one sees it
            self._fail_all(exc)
            raise

    def _fail_all(self, exc: BaseException) -> None:
        """End every admitted and waiting sequence with `exc` (its request gets the error instead of hanging)."""
        with self._cond:
            everyone = [*self._admitted(), *self._waiting]
            self._running, self._prefilling, self._chunking, self._waiting = [], [], None, collections.deque()
        for sequence in everyone:
            sequence.fail(exc)

    def _steps(self, compute: ComputeThread) -> None:
        while True:
            with self._cond:
                if not (self._waiting or self._running or self._chunking or self._jobs):
                    self._report_load(force=True)  # idle: the gauges say so
                    compute.cores.idle()  # the node's other engines may take its cores
                while not (self._closed or self._waiting or self._running or self._chunking or self._jobs):
                    self._cond.wait()
                if self._closed:
                    return
            compute.use_share()
            self._step_started_at = time.monotonic()
            with torch.inference_mode():
                self.step()
            self._step_started_at = None
            self._report_load()

    def _report_load(self, force: bool = False) -> None:
        """Running and queued sequences to the metrics, at most twice a second while busy."""
        now = time.monotonic()
        if self.model_id is None or (not force and now - self._reported_at < _REPORT_S):
            return
        self._reported_at = now
        stats = self.stats()
        metrics.sequences(self.model_id, stats["running"], stats["waiting"])
        metrics.kv_cache(self.model_id, stats["kv_cache_bytes"], stats["kv_cache_budget_bytes"])

    def step(self) -> None:
        """One scheduling step (public for tests that drive the scheduler without its thread)."""
        self._run_jobs()
        self._drop_cancelled()
        self._prefill()
        self._decode()
        self._measure()
        self.steps += 1

    def _measure(self) -> None:
        """Record what the KV caches hold after the step (the budget's figures, as measured)."""
        caches = [c.cache for c in (self._batch, self._chunking[1] if self._chunking else None) if c is not None]
        self.memory.measure(caches)

    def _run_jobs(self) -> None:
        while self._jobs:
            with self._cond:
                fn, future = self._jobs.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except Exception as exc:  # handed to whoever waits on the job
                    future.set_exception(exc)

    def _drop_cancelled(self) -> None:
        with self._cond:
            self._waiting = collections.deque(s for s in self._waiting if not s.cancelled)
            if self._chunking is not None and self._chunking[0].cancelled:
                self._chunking = None
        self._retire()

    def _admit(self) -> list[Sequence]:
        """Take the waiting sequences to prefill this step (`Admission`, within the KV budget): a group of whole
        prompts (now `_prefilling`), or one prompt that starts `_chunking` (long, or starting from cached blocks)."""
        if self._waiting and not self.memory.position_bytes:
            self.memory.probe(self.model)
        with self._cond:
            self._find_prefixes()
            count = self.admission.group(self._waiting, self._running, self._free_slots(), self._fits)
            if count == 0 and self._waiting and not self._fits([self._waiting[0]], alone=True):
                self._refuse(self._waiting.popleft())
                return []
            group = [self._waiting.popleft() for _ in range(count)]
            if len(group) == 1 and self.admission.chunked(group[0]):
                self._chunking = (group[0], self._chunk_cache(group[0]))
                return []
            self._prefilling = group
        for sequence in group:
            sequence.prefilled = 0  # a group is prefilled whole
        return group

    def _prefill(self) -> None:
        if self._chunking is None:
            group = self._admit()
            if group:
                self._guarded(group, lambda: self._prefill_group(group))
                return
        if self._chunking is not None:
            sequence, cache = self._chunking
            self._guarded([sequence], lambda: self._prefill_chunk(sequence, cache))

    def _prefill_group(self, group: list[Sequence]) -> None:
        """Prefill whole prompts as one left-padded batch, then sample each one's first token."""
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
        self._started(group, logits[:, -1, :], cache)

    def _prefill_chunk(self, sequence: Sequence, cache: BatchCache) -> None:
        """Feed the next chunk of a long prompt (after the cached blocks it starts with); after the last one it
        joins the running batch."""
        start = sequence.prefilled
        chunk = sequence.prefill_ids[start: start + self.limits.prefill_chunk_tokens]
        ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
        positions = torch.arange(start, start + len(chunk), device=self.device).unsqueeze(0)
        scored = sequence.scores_prompt
        logits = self._forward([sequence], ids, cache.mask_with(len(chunk)), positions, cache,
                               every_position=scored)
        if scored:
            self._score_prompt(sequence, logits[0], start)
        sequence.prefilled += len(chunk)
        if sequence.prefilled == len(sequence.prefill_ids):
            self._started([sequence], logits[:, -1, :], cache)

    def _score_prompt(self, sequence: Sequence, logits: torch.Tensor, start: int) -> None:
        """Logprobs of the prompt's tokens after `start` from the logits of the positions before them."""
        targets = sequence.prompt_ids[start + 1: start + 1 + logits.shape[0]]
        found = logprobs_of(logits[: len(targets)], targets, sequence.params.logprobs or 0)
        if sequence.prompt_logprobs is None:  # the first token has nothing before it
            sequence.prompt_logprobs = [TokenLogprob(sequence.detokenizer.token_text(sequence.prompt_ids[0]), None)]
        sequence.prompt_logprobs.extend(sequence.token_logprob(f) for f in found)

    def _started(self, group: list[Sequence], logits: torch.Tensor, cache: BatchCache) -> None:
        """Sequences whose prompt is in `cache`: their blocks go to the prefix cache, and each choice (a fork gets a
        copy of its request's cache row) takes its first token and joins the running batch (making room for it)."""
        for row, sequence in enumerate(group):
            self._keep_prefix(sequence, cache, row)
        rows = [row for row, s in enumerate(group) for _ in s.joining]
        choices = [choice for s in group for choice in s.joining]
        if len(choices) > len(group):
            cache.keep(rows)
            logits = logits[rows]
        for choice in choices:
            if choice.params.max_tokens == 0:
                choice.finish_empty()
        self._sample(choices, logits)
        with self._cond:
            self._prefilling, self._chunking = [], None
        self._make_room(lambda: self._merged_bytes(cache))
        if self._batch is None:
            self._batch = cache
        else:
            self._batch.merge(cache)
        with self._cond:
            self._running.extend(choices)
        self._retire()

    def _decode(self) -> None:
        self._make_room(self._bytes_after_step, finish_alone=True)
        if self._batch is None or not self._running:
            return
        batch, running = self._batch, list(self._running)
        ids = torch.tensor([[s.output_ids[-1]] for s in running], dtype=torch.long, device=self.device)

        def run() -> None:
            if self.fast_decode is not None and (self.adapters is None or self.adapters.peft is None):
                logits = self.fast_decode.step(ids, batch)
            else:
                logits = self._forward(running, ids, batch.mask_with(1), batch.next_positions(), batch)
            self._sample(running, logits[:, -1, :])

        self._guarded(running, run)
        self._retire()

    def _sample(self, sequences: list[Sequence], logits: torch.Tensor) -> None:
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

    def _retire(self) -> None:
        """Drop finished and cancelled sequences from the running batch (their blocks go to the prefix cache)."""
        keep = [i for i, s in enumerate(self._running) if not s.done]
        if len(keep) == len(self._running):
            return
        for row, sequence in enumerate(self._running):
            if sequence.done and self._batch is not None:
                self._keep_prefix(sequence, self._batch, row)
        with self._cond:
            self._running = [self._running[i] for i in keep]
        if not keep:
            self._batch = None
        elif self._batch is not None:
            self._batch.keep(keep)

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

    def _guarded(self, sequences: list[Sequence], work: Any) -> None:
        """Run one piece of model work; if it raises, the sequences it served fail with the error (others go on)."""
        for s in sequences:
            s.started_at = s.started_at or time.perf_counter()
        try:
            work()
        except Exception as exc:
            logger.exception("generation failed for %d sequence(s)", len(sequences))
            for s in sequences:
                s.fail(exc)
            with self._cond:
                self._prefilling = [s for s in self._prefilling if s not in sequences]
                if self._chunking is not None and self._chunking[0] in sequences:
                    self._chunking = None
            self._retire()


def _logits_width(model: Any) -> int:
    """How many logits a step gives: the output head's width (quantized heads keep `out_features`; padded
    vocabularies make it differ from the tokenizer's size), else the config's vocabulary."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    if width is None:
        config = model.config
        width = getattr(config, "vocab_size", None) or config.get_text_config().vocab_size
    return int(width)
