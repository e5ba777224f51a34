"""Whole prompts prefilled aside: in a second thread of an engine while its step loop goes on decoding.

When the engine's share of the node is two cores or more (on a CPU), prompts that would be fed beside a decode step
(`Beside`: whole text prompts of the base model, each from the blocks it finds cached) are prefilled instead in the
`PrefillThread` with one torch thread, by the fast step's `prefill` (it reads no batch), while the step loop decodes
with one torch thread meanwhile; they join the batch at the first step after they are done. Decode then never waits
on a prefill, and a model busy alone keeps both cores working as two busy models would: one engine's two-thread ops
wait at every barrier, and most of a small step's operations do not split (figures: docs/performance.md, "Prefill
aside"). One batch of prompts is aside at a time; the queue waits meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from rayrunner.engines.transformers.kv.kv_batch import BatchCache
from rayrunner.engines.transformers.kv.kv_budget import KvBudget
from rayrunner.engines.transformers.step.compute_thread import ComputeThread, PrefillThread
from rayrunner.engines.transformers.step.model_runner import ModelRunner, Prompts
from rayrunner.engines.transformers.step.sequence import Sequence


@dataclass
class Flight:
    """Prompts being prefilled aside: their last positions' logits come in `done`."""

    prompts: Prompts
    done: Future[torch.Tensor]
    nbytes: int  # what their caches will hold, as the planner counts them

    @property
    def sequences(self) -> list[Sequence]:
        return [sequence for sequence, _, _, _ in self.prompts]


class PrefillAside:
    """A step scheduler's prefill thread (once `enable`d) and the prompts in it. `wake` is called when they are
    done."""

    def __init__(self, runner: ModelRunner, wake: Callable[[], None]) -> None:
        self.runner, self._wake = runner, wake
        self.compute: ComputeThread | None = None  # the step loop's thread, whose share of the node is checked
        self.thread: PrefillThread | None = None
        self.flight: Flight | None = None
        self.prompts_fed = 0  # prompts prefilled aside so far

    def enable(self, compute: ComputeThread) -> None:
        """Prefill aside from now on, beside the step loop on `compute`, if the model's fast step can
        (`FastDecode.prefills_aside`) on a CPU."""
        fast = self.runner.fast_decode
        if fast is not None and fast.prefills_aside and self.runner.device.type == "cpu":
            self.compute, self.thread = compute, PrefillThread("prefill-aside")

    def pays(self, prompts: int, rows: int) -> bool:
        """Whether `prompts` go aside now, beside `rows` decoding: none are, the engine's share is 2 cores or more,
        and they are no more than the rows (more prompts than rows, as when a wave of streams starts together, are
        prefilled faster by both cores in the step's own forward, while the few rows would soon be done)."""
        return self.compute is not None and self.flight is None and 0 < prompts <= rows \
            and self.runner.batch is not None and self.compute.cores.threads >= 2

    def start(self, spans: list[tuple[Sequence, int, int]], budget: KvBudget) -> None:
        """Prefill each (sequence, start, end) aside, from its cached blocks; the step loop keeps one torch thread
        until they are done."""
        assert self.thread is not None
        prompts = [(s, start, end, self.runner.prompt_cache(s, start)) for s, start, end in spans]
        nbytes = sum(budget.bytes_of(s.slots, len(s.prefill_ids)) for s, _, _ in spans)
        torch.set_num_threads(1)
        done = self.thread.submit(self.runner.prefill_aside, prompts)
        self.flight = Flight(prompts, done, nbytes)
        self.prompts_fed += len(prompts)
        done.add_done_callback(lambda _: self._wake())

    @property
    def busy(self) -> bool:
        return self.flight is not None

    @property
    def nbytes(self) -> int:
        return self.flight.nbytes if self.flight is not None else 0

    def ready(self) -> bool:
        return self.flight is not None and self.flight.done.done()

    def join(self, joined: Callable[[list[Sequence], torch.Tensor, list[BatchCache]], None],
             guarded: Callable[[list[Sequence], Callable[[], None]], None], wait: bool = False) -> None:
        """Once the prompts aside are done (`wait`: wait for them), `joined` takes them (their logits and caches),
        run by `guarded`, which fails them if it raises (their prefill's error too)."""
        flight = self.flight
        if flight is None or not (wait or flight.done.done()):
            return
        self.flight = None

        def work() -> None:
            logits = flight.done.result()
            for sequence, _, end, _ in flight.prompts:
                sequence.prefilled = end
            joined(flight.sequences, logits, [cache for _, _, _, cache in flight.prompts])

        guarded(flight.sequences, work)

    def drop(self) -> None:
        """Forget the prompts aside (their sequences failed): what the thread still computes is dropped."""
        self.flight = None

    def close(self) -> None:
        """Finish what is aside, and end the thread."""
        if self.thread is not None:
            self.thread.shutdown()
