"""The step scheduler: iteration-level batching of one model's sequences, in a worker thread of the replica.

Three parts, split as vLLM's engine core splits its scheduler from its model runner: this loop (`StepScheduler`:
the thread, the queue, the request side, health and stats, and which sequences wait, are prefilled, chunked or run);
the planner (`planner`: on plain figures, what each step admits, chunks, preempts or refuses); and the model runner
(`model_runner`: the tensors, which carry each plan out). Every step the loop
1. drops cancelled sequences (a client that hung up stops costing work at once),
2. prefills at most one chunk's worth of prompt tokens: the planner admits waiting sequences while fewer than
   `max_num_seqs` run and the KV budget has room, as several short prompts in one padded batch, or the next
   `prefill_chunk_tokens` of one long prompt or of one whose start is in the prefix cache, so running streams wait
   at most one chunk per step (a request for a LoRA adapter waits while `max_adapters` other adapters are in use),
3. decodes one token for every running sequence in one forward pass over the shared `BatchCache`, with each
   sequence's own sampling settings, after making room for the step in the KV budget (the planner says what gives
   way: prefix blocks, then the newest sequences, preempted), and retires the ones that finished (their blocks go to
   the prefix cache).
While rows decode and the model has the fast decode step, text prompts are fed beside them in one forward (vLLM's
mixed batch): several whole ones within one chunk's tokens (each from the blocks it finds cached), or a chunk; the
decode rows ride along in the prompts' matmuls, and the prompts join after the step. With no rows decoding, such
whole prompts are fed together on their own (a wave of streams arriving at an idle engine is one forward). When the
engine's share of the node is two cores or more, such whole prompts are prefilled aside instead, in a second thread,
while the decode steps go on (`prefill_aside`).
Sequences join and leave between steps without recomputing anyone else's cache. Past `max_queued_requests` waiting
sequences, `submit` refuses with `ServerOverloadedError` (HTTP 429). The loop runs on the engine's `ComputeThread`,
the thread that loaded the model (`compute_thread` says why one thread does all the work). With LoRA adapters, one
batch mixes adapters and the base model; adapters are loaded between steps (`between_steps`) or when a sequence
first needs one.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
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
from rayrunner.engines.transformers.kv.kv_batch import (
    BatchCache,
    compacted_rows,
    mergeable,
    plain_attention,
    recurrent,
)
from rayrunner.engines.transformers.kv.kv_memory import KvMemory
from rayrunner.engines.transformers.step.admission import Admission
from rayrunner.engines.transformers.step.compute_thread import ComputeThread
from rayrunner.engines.transformers.step.fast_decode import FastDecode
from rayrunner.engines.transformers.step.model_runner import ModelRunner, logits_width
from rayrunner.engines.transformers.step.planner import Beside, Chunk, Group, KvState, Planner, Refuse, Room
from rayrunner.engines.transformers.step.prefill_aside import PrefillAside
from rayrunner.engines.transformers.step.sequence import Sequence, events_of
from rayrunner.errors import InvalidRequestError, ServerOverloadedError
from rayrunner.models.spec import EngineSettings
from rayrunner.openai.events import GenerationEvent
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.runtime import metrics

logger = logging.getLogger(__name__)
_REPORT_S = 0.5  # the running/queued gauges' refresh while busy
STUCK_STEP_S = 300.0  # one step (a prefill chunk and a decode) taking longer than this means the engine is wedged
T = TypeVar("T")
Prefill = Group[Sequence] | Chunk[Sequence] | Beside[Sequence] | Refuse[Sequence] | None


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int = 32
    max_queued_requests: int = 256
    prefill_chunk_tokens: int = 2048
    kv_cache_bytes: int | None = None  # None: `kv_memory`'s default for the device
    prefix_caching: bool = True
    gpu_share: float = 0.0  # of its GPU this replica reserved (`engine.num_gpus`): the default budget's part of it
    prefill_aside: bool = True  # whole prompts prefilled in a second thread while rows decode (`prefill_aside`)


def scheduler_limits(settings: EngineSettings) -> SchedulerLimits:
    return SchedulerLimits(settings.max_num_seqs, settings.max_queued_requests, settings.prefill_chunk_tokens,
                           settings.kv_cache_bytes, settings.prefix_caching, settings.num_gpus,
                           prefill_aside=settings.prefill_aside)


class StepScheduler:
    """Runs one model's sequences step by step in a daemon thread; `submit` may be called from any thread."""

    def __init__(self, model: Any, limits: SchedulerLimits, adapters: LoraAdapters | None = None,
                 model_id: str | None = None) -> None:
        """`model_id` labels the running/queued gauges this scheduler reports (`rayrunner.runtime.metrics`);
        None: none."""
        self.model = model
        self.model_id = model_id
        self.adapters = adapters
        self.device = model.device
        self.vocab_size = logits_width(model)
        self.limits = limits
        shared = mergeable(model.config)
        self.max_running = limits.max_num_seqs if shared else 1
        if not shared:
            logger.warning("this model's KV cache cannot be shared by several sequences: one runs at a time")
        self.planner = Planner(Admission(limits.prefill_chunk_tokens, adapters.max_adapters if adapters else None,
                                         one_per_pass=recurrent(model.config)))
        reuse = limits.prefix_caching and plain_attention(model.config)  # the prefix cache's blocks are plain layers
        self.memory = KvMemory(limits.kv_cache_bytes, self.device, reuse, limits.gpu_share)
        self.runner = ModelRunner(model, self.memory, adapters, self.active_adapters)
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []  # row i of the runner's batch is `_running[i]`
        self._joins = itertools.count(1)  # numbers the sequences joining `_running` (`Sequence.joined`)
        self._chunking: Sequence | None = None  # a long prompt being prefilled chunk by chunk
        self._prefilling: list[Sequence] = []  # taken from the queue, not yet running
        self._jobs: collections.deque[tuple[Callable[[], Any], Future[Any]]] = collections.deque()
        self._closed = False
        self._loop_done: Future[None] | None = None
        self._step_started_at: float | None = None  # while a step runs (health checks spot a stuck one)
        self._aside = PrefillAside(self.runner, self._wake)  # whole prompts prefilled while rows decode (`start`)
        self._died_of: BaseException | None = None
        self._reported_at = 0.0
        self.steps = 0

    @property
    def fast_decode(self) -> FastDecode | None:
        """The runner's fast decode step (None: the model's forward decodes)."""
        return self.runner.fast_decode

    @fast_decode.setter
    def fast_decode(self, step: FastDecode | None) -> None:
        self.runner.fast_decode = step

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
                    else 0, "preemptions": memory.preemptions,
                    "prefilled_aside": self._aside.prompts_fed}

    def _free_slots(self) -> int:
        """Sequence slots no admitted sequence holds (call with the lock held)."""
        held = len(self._running) + sum(s.slots for s in self._prefilling)
        return self.max_running - held - (self._chunking.slots if self._chunking is not None else 0)

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
        return [*self._running, *self._prefilling, *([self._chunking] if self._chunking is not None else [])]

    def start(self, compute: ComputeThread) -> None:
        """Run steps on `compute` whenever there is work (tests may instead call `step` themselves). The fast decode
        step is made there too: it concatenates weights, and a torch op in another thread slows every later one
        (`compute_thread`)."""
        self.fast_decode = compute.call(FastDecode.for_model, self.model)
        if self.limits.prefill_aside:
            self._aside.enable(compute)
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
        self._aside.close()

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
            self._aside.drop()
            self.runner.drop_chunk()
        for sequence in everyone:
            sequence.fail(exc)

    def _steps(self, compute: ComputeThread) -> None:
        while True:
            with self._cond:
                if not self._has_work():
                    self._report_load(force=True)  # idle: the gauges say so
                    if not self._aside.busy:
                        compute.cores.idle()  # the node's other engines may take its cores
                while not (self._closed or self._has_work()):
                    self._cond.wait()
                if self._closed:
                    return
            compute.use_share(1 if self._aside.busy else None)
            self._step_started_at = time.monotonic()
            with torch.inference_mode():
                self.step()
            self._step_started_at = None
            self._report_load()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def _has_work(self) -> bool:
        """Something a step would do now (the queue waits while prompts are aside: nothing starts meanwhile)."""
        startable = bool(self._waiting or self._chunking is not None) and not self._aside.busy
        return bool(self._running or self._jobs) or startable or self._aside.ready()

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
        self._aside.join(self._joined, self._guarded, wait=bool(self._jobs))  # a job may change the model
        self._run_jobs()
        self._drop_cancelled()
        plan = self._plan_prefill() if not self._aside.busy else None
        if isinstance(plan, Beside) and self._aside.pays(len(plan.sequences), len(self._running)):
            self._aside.start(plan.spans, self.memory.budget())
            self._decode()
        elif isinstance(plan, Beside) or (isinstance(plan, Chunk) and self._mixes(plan)):
            self._decode_with_prompts(plan)
        else:
            self._prefill(plan)
            self._decode()
        self.runner.measure()
        self.steps += 1

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
            if self._chunking is not None and self._chunking.cancelled:
                self._chunking = None
                self.runner.drop_chunk()
        self._retire()

    def _by_age(self) -> list[Sequence]:
        """The running sequences, oldest first (the planner preempts the newest; rows are not in that order once
        `_retire` has moved rows from the end into the places of finished ones)."""
        return sorted(self._running, key=lambda sequence: sequence.joined)

    def _kv(self) -> KvState:
        """The KV memory's figures now, for the planner."""
        return KvState(self.memory.budget(), self.runner.batch_shape(), self._aside.nbytes)

    def _held_after_step(self) -> int:
        return self.planner.held_after_step(self._kv(), self._chunking)

    # ------------------------------------------------------------ prefill

    def _prefill(self, plan: Prefill) -> None:
        if isinstance(plan, Refuse):
            self._refuse(plan)
        elif isinstance(plan, Group):
            group = list(plan.sequences)
            self._guarded(group, lambda: self._group_started(group))
        elif isinstance(plan, Chunk):
            chunk = plan
            self._guarded([chunk.sequence], lambda: self._prefill_chunk(chunk))
        elif isinstance(plan, Beside):  # no rows to decode beside: the prompts are fed on their own
            self._feed_together(plan)

    def _plan_prefill(self) -> Prefill:
        """This step's prefill, as the planner has it: the next chunk of the prompt being chunked, else what starts
        from the queue (taken from it under the lock, with the prefix blocks its candidates find)."""
        if self._chunking is not None:
            return self.planner.next_chunk(self._chunking)
        if not self._waiting:
            return None
        self.runner.probe()
        with self._cond:
            candidates = list(self._waiting)[: max(self._free_slots(), 1)]
            cached = self.runner.find_prefixes(candidates)
            plan = self.planner.admit(candidates, cached, self._running, self._free_slots(), self._kv(),
                                      self.runner.mixes)
            self._take(plan)
        return plan

    def _take(self, plan: Prefill) -> None:
        """Take what `plan` starts from the head of the queue (call with the lock held)."""
        if isinstance(plan, Refuse):
            self._waiting.popleft()
        elif isinstance(plan, Group):
            for sequence in plan.sequences:
                self._waiting.popleft()
                sequence.prefilled = 0  # a group is prefilled whole
            self._prefilling = list(plan.sequences)
        elif isinstance(plan, Chunk):
            self._chunking = self._take_cached(plan.start)
            self.runner.start_chunk(self._chunking, plan.start)
        elif isinstance(plan, Beside):
            self._prefilling = [self._take_cached(start) for start in plan.starts]

    def _take_cached(self, start: int) -> Sequence:
        """Take the head of the queue, whose cache starts with the `start` tokens found in the prefix cache (call
        with the lock held)."""
        sequence = self._waiting.popleft()
        sequence.prefilled = start
        if start and not sequence.resumed:
            sequence.cached_tokens = start
        return sequence

    def _refuse(self, plan: Refuse[Sequence]) -> None:
        """A sequence that cannot fit the KV budget even alone: a prompt is refused (400); a resumed sequence (its
        output grew it past the budget) ends with finish_reason `length`."""
        sequence = plan.sequence
        if sequence.resumed:
            sequence.finish_length()
            return
        sequence.fail(InvalidRequestError(
            f"the prompt's {len(sequence.prompt_ids)} tokens (x{sequence.slots} choices) need {plan.needed:,} bytes "
            f"of KV cache, more than this model's budget of {self.memory.limit:,} (engine.kv_cache_bytes)",
            param="messages"))

    def _prefill_chunk(self, chunk: Chunk[Sequence]) -> None:
        """Feed the planned chunk of a long prompt; after the last one it joins the running batch."""
        logits, cache = self.runner.prefill_chunk(chunk.sequence, chunk.start, chunk.end)
        if chunk.last:
            self._started([chunk.sequence], logits, [cache])

    def _group_started(self, group: list[Sequence]) -> None:
        logits, cache = self.runner.prefill_group(group)
        self._started(group, logits, [cache])

    def _started(self, group: list[Sequence], logits: torch.Tensor, caches: list[BatchCache]) -> None:
        """Sequences whose prompts are in `caches` (each holding the next of them, in order): their blocks go to the
        prefix cache, each choice takes its first token, and they join the running batch once the planner's room is
        made, in one copy of every cache."""
        rows = [(cache, row) for cache in caches for row in range(cache.rows)]
        self.runner.keep_prefixes([(cache, row, s) for (cache, row), s in zip(rows, group, strict=True)],
                                  self._held_after_step)
        choices = self.runner.first_tokens(group, logits, caches)
        with self._cond:
            self._prefilling, self._chunking = [], None
        self.runner.drop_chunk()  # a chunked prompt's cache is in `caches`, which join the batch
        joining = self.runner.shape(caches)
        self._make_room(lambda: self.planner.room_to_join(self._kv(), joining, self._by_age()))
        self.runner.join(caches)
        for choice in choices:
            choice.joined = next(self._joins)
        with self._cond:
            self._running.extend(choices)
        self._retire()

    # ------------------------------------------------------------ a prompt fed beside the decode step

    def _mixes(self, plan: Chunk[Sequence]) -> bool:
        """Whether the chunk is fed beside this step's decode rather than in a forward of its own."""
        return bool(self._running) and self.runner.mixes(plan.sequence)

    def _decode_with_prompts(self, plan: Chunk[Sequence] | Beside[Sequence]) -> None:
        """One forward for the decode rows and the planned prompts' tokens; prompts fully fed join the running
        batch after the step (`_started`). A chunk preempted while room was made waits again and the rows decode
        alone; with no rows (left) to decode, the prompts are prefilled on their own, then decode."""
        room = self._make_room(lambda: self.planner.room_for_step(self._kv(), self._by_age(), self._chunking))
        spans = [(s, start, end) for s, start, end in plan.spans if s is self._chunking or s in self._prefilling]
        if not spans:
            self._decode()
            return
        if self.runner.batch is None or not self._running:  # as a step without rows: the prompts, then a decode
            self._prefill(plan)
            self._decode()
            return
        running, runner = list(self._running), self.runner
        prompts = [(s, start, end, runner.chunk if s is self._chunking and runner.chunk is not None
                    else runner.prompt_cache(s, start)) for s, start, end in spans]

        def work() -> None:
            logits = runner.decode_with_prompts(running, room.max_positions, prompts)
            fed = [(s, row, cache) for (s, _, end, cache), row in zip(prompts, logits, strict=True)
                   if end == len(s.prefill_ids)]
            if fed:
                self._joined([s for s, _, _ in fed], torch.cat([row for _, row, _ in fed]), [c for _, _, c in fed])

        self._guarded([*running, *(s for s, _, _ in spans)], work)
        self._retire()

    def _feed_together(self, plan: Beside[Sequence]) -> None:
        """Whole prompts fed together with no rows decoding, each on a cache of its own from its cached blocks (the
        fast step's `prefill`); they start after it."""
        sequences = list(plan.sequences)
        prompts = [(s, start, end, self.runner.prompt_cache(s, start)) for s, start, end in plan.spans]
        caches = [cache for _, _, _, cache in prompts]
        self._guarded(sequences, lambda: self._joined(sequences, self.runner.feed_prompts(prompts), caches))

    def _joined(self, sequences: list[Sequence], logits: torch.Tensor, caches: list[BatchCache]) -> None:
        """Prompts fully fed (beside a decode step, or aside) start, each from its own cache."""
        self._started(sequences, logits, caches)

    # ------------------------------------------------------------ decode and the KV moves

    def _decode(self) -> None:
        room = self._make_room(lambda: self.planner.room_for_step(self._kv(), self._by_age(), self._chunking))
        if self.runner.batch is None or not self._running:
            return
        running = list(self._running)
        self._guarded(running, lambda: self.runner.decode(running, room.max_positions))
        self._retire()

    def _make_room(self, plan: Callable[[], Room[Sequence]]) -> Room[Sequence]:
        """Carry out the planner's room for a move: prefix blocks give way, a sequence is preempted and the room
        planned again while it says so; a sequence alone without room ends (`length`). The room it ends with."""
        room = plan()
        self.memory.evict(room.evict)
        while room.preempt is not None:
            self._preempt(room.preempt)
            room = plan()
            self.memory.evict(room.evict)
        if room.finish is not None:
            room.finish.finish_length()
            self._retire()
        return room

    def _preempt(self, sequence: Sequence) -> None:
        """Drop `sequence`'s cache; it waits at the head of the queue to be prefilled again."""
        with self._cond:
            if self._chunking is sequence:
                self._chunking = None
                self.runner.drop_chunk()
            else:
                index = self._running.index(sequence)
                self._running.pop(index)
                self.runner.drop_row(index)
            sequence.prefilled = 0
            self._waiting.appendleft(sequence)
        self.memory.preemptions += 1
        if self.model_id is not None:
            metrics.preempted(self.model_id)
        logger.info("KV budget full: a sequence of %d tokens is preempted (recomputed later)",
                    len(sequence.prefill_ids))

    def _retire(self) -> None:
        """Drop finished and cancelled sequences from the running batch (their blocks go to the prefix cache)."""
        done_rows = [s.done for s in self._running]
        if not any(done_rows):
            return
        keep = compacted_rows(done_rows)
        if self.runner.batch is not None:
            batch = self.runner.batch
            done = [(batch, row, s) for row, s in enumerate(self._running) if s.done]
            self.runner.keep_prefixes(done, self._held_after_step)
        with self._cond:
            self._running = [self._running[i] for i in keep]
        self.runner.keep_rows(keep)

    def _guarded(self, sequences: list[Sequence], work: Callable[[], None]) -> None:
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
                if self._chunking is not None and self._chunking in sequences:
                    self._chunking = None
                    self.runner.drop_chunk()
            self._retire()

