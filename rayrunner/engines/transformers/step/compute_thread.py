"""One thread per engine for torch's heavy work, and a one-thread limit on torch in every other thread.

On Linux torch runs its parallel ops through libgomp, which gives every thread that starts a parallel region a pool
of workers of its own. Once a process holds more OpenMP threads than it has cores, libgomp stops spinning between
regions and every worker sleeps until woken, so each op pays a wake-up. On a 2-core box a Q8_0 SmolLM2 decode step
took 35 ms when the model was loaded in one thread and decoded in another, against 20 ms when one thread did both
(a bf16 matmul 150 us against 75 us). So an engine loads its model and runs its step loop (or its batches) on one
`ComputeThread`, and what little torch work runs elsewhere (image preprocessing) runs with `single_threaded_torch`.

How many threads that one thread's pool has follows the engine's `CoreShare` of the node: before each job (and the
step scheduler before each step) `use_share` sizes it; when no job is left the share is given back.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from rayrunner.runtime.core_share import CoreShare

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ComputeThread:
    """A single daemon worker thread (an idle one never holds up the interpreter's exit, unlike an executor's):
    `call` blocks on a function run there, `run` awaits one, `submit` starts a long one. `max_threads` caps its
    share of the node's cores (the spec's `torch_threads`)."""

    def __init__(self, name: str, max_threads: int | None = None) -> None:
        self.cores = CoreShare(cap=max_threads)
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((functools.partial(fn, *args), future))
        return future

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        return self.submit(fn, *args).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Finish what was submitted, then end the thread (its OpenMP pool goes with it)."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread() and not sys.is_finalizing():
            self._thread.join(timeout=30)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            call, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                self.use_share()
                future.set_result(call())
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
            if self._jobs.empty():
                self.cores.idle()
        self.cores.idle()

    def use_share(self, cap: int | None = None) -> None:
        """On this thread: size torch's pool to the engine's share of the node's cores now (`CoreShare`), at most
        `cap` threads (the rest of the share busy elsewhere: `PrefillThread`)."""
        threads = min(self.cores.working(), cap or sys.maxsize)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)


class PrefillThread(ComputeThread):
    """A second worker of an engine, beside its `ComputeThread`: the step scheduler prefills prompts here while the
    compute thread decodes, each with one torch thread on one core of the engine's share. It holds no lease of its
    own (the engine's share counts both), and is never more than one torch thread (two OpenMP pools in one process
    past the cores would slow every op: see above)."""

    def use_share(self, cap: int | None = None) -> None:
        single_threaded_torch()


@functools.cache
def _libgomp() -> Any:
    """torch's OpenMP runtime (a second dlopen of the same soname returns the copy torch loaded), or None."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        logger.info("torch's OpenMP runtime is not libgomp: other threads keep torch's thread count")
        return None


def single_threaded_torch() -> None:
    """Run torch single-threaded in the calling thread only. OpenMP's thread count is per thread, while
    `torch.set_num_threads` would also change the process-wide default and MKL's count for the compute thread."""
    gomp = _libgomp()
    if gomp is None:
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP count once, on its first use: let it, then override
    gomp.omp_set_num_threads(1)


async def run_single_threaded(fn: Callable[..., T], *args: Any) -> T:
    """Run a light torch function in asyncio's default thread pool, single-threaded (see `single_threaded_torch`)."""

    def call() -> T:
        single_threaded_torch()
        return fn(*args)

    return await asyncio.to_thread(call)
