"""The replica's engine behind a slot that can sleep: the weights are freed while the process stays (imports,
tokenizer, Serve's replica), and the next request or `wake` rebuilds the engine from the local cache.

Every request holds the slot while it runs (`use`), so `sleep` first lets in-flight requests finish, and requests
that arrive meanwhile wait for it, then wake the engine again. On every device sleeping drops the weights; waking
re-reads them (for SmolLM2 on CPU a fraction of a second, against several for a new replica process).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from rayrunner.deployments.engine import Engine
from rayrunner.errors import ModelTimeoutError

logger = logging.getLogger(__name__)


class EngineSlot:
    def __init__(self, build: Callable[[], Engine]) -> None:
        self._build = build
        self.engine: Engine | None = build()
        self._lock = asyncio.Lock()  # sleep and wake run alone; requests pass it to start
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.slept_at: float | None = None
        self.last_wake_s: float | None = None

    @property
    def asleep(self) -> bool:
        return self.engine is None

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[Engine]:
        """The engine for one request (woken first if asleep), held until the request ends."""
        async with self._lock:
            if self.engine is None:
                await self._wake()
            engine = self.engine
            assert engine is not None
            self._active += 1
            self._idle.clear()
        try:
            yield engine
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def sleep(self, drain_timeout_s: float) -> None:
        """Free the weights once in-flight requests are done (new ones wait, then wake the engine)."""
        async with self._lock:
            if self.engine is None:
                return
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
            except TimeoutError:
                raise ModelTimeoutError(
                    f"requests still running after {drain_timeout_s:.0f} s: not put to sleep") from None
            engine, self.engine = self.engine, None
            await asyncio.to_thread(engine.close)
            del engine  # the last reference: the weights go now
            _free_memory()
            self.slept_at = time.time()

    async def wake(self) -> None:
        async with self._lock:
            if self.engine is None:
                await self._wake()

    async def _wake(self) -> None:
        start = time.perf_counter()
        self.engine = await asyncio.to_thread(self._build)
        self.last_wake_s = time.perf_counter() - start
        self.slept_at = None
        logger.info("woke up in %.2f s", self.last_wake_s)

    def state(self) -> dict[str, Any]:
        return {"asleep": self.asleep, "slept_at": self.slept_at, "last_wake_s": self.last_wake_s}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _free_memory() -> None:
    """Collect the dropped engine's cycles now, hand freed heap pages back to the OS (glibc keeps freed blocks of
    the sizes torch allocates in its arenas otherwise), and return the accelerator's cached blocks."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
