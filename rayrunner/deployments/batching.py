"""Dynamic batching: requests that arrive together are generated together in one forward pass per step.

Jobs wait up to `wait_s` for companions, then the largest compatible group (same sampling settings) runs as one
batch in a worker thread while the event loop keeps accepting requests. One batch runs at a time per replica.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from rayrunner.deployments.engine import GenerationEvent, SamplingParams


@dataclass(eq=False)
class GenerationJob:
    """One request's place in a batch: its prompt, settings and the queue its events go to."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[GenerationEvent | BaseException] = field(default_factory=asyncio.Queue)
    cancelled: bool = False

    def emit(self, item: GenerationEvent | BaseException) -> None:
        """Thread-safe: hand an event (or the error that ended the batch) to the waiting request."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    def group_key(self) -> Hashable:
        p = self.params
        if p.greedy:
            return ("greedy",)
        return ("sample", p.temperature, p.top_p, p.top_k, p.seed)


class DynamicBatcher:
    """Collects jobs and runs compatible ones together through `run_batch` (called in a thread)."""

    def __init__(self, run_batch: Callable[[list[GenerationJob]], None], max_batch_size: int, wait_s: float):
        self._run_batch = run_batch
        self._max = max_batch_size
        self._wait_s = wait_s
        self._backlog: collections.deque[GenerationJob] = collections.deque()
        self._arrived = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None

    def submit(self, job: GenerationJob) -> None:
        self._backlog.append(job)
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve_forever())

    async def _serve_forever(self) -> None:
        while True:
            await self._arrived.wait()
            if len(self._backlog) < self._max and self._wait_s > 0:
                await asyncio.sleep(self._wait_s)
            batch = self._take_batch()
            if not self._backlog:
                self._arrived.clear()
            if batch:
                await self._run(batch)

    def _take_batch(self) -> list[GenerationJob]:
        live = [job for job in self._backlog if not job.cancelled]
        self._backlog.clear()
        if not live:
            return []
        key = live[0].group_key()
        batch = [job for job in live if job.group_key() == key][: self._max]
        self._backlog.extend(job for job in live if job not in batch)
        return batch

    async def _run(self, batch: list[GenerationJob]) -> None:
        try:
            await asyncio.to_thread(self._run_batch, batch)
        except Exception as exc:  # the batch failed as a whole: every request in it gets the error
            for job in batch:
                job.emit(exc)
