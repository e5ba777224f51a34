"""The replica's engine behind a slot that can sleep: the engine frees its weights (rayrunner's engines park them in a
local file, `parked_weights`; vLLM uses its own sleep mode) while the rest stays (process, imports, tokenizer, Serve's
replica), and the next request or `wake` puts them back.

Every request holds the slot while it runs (`use`), so `sleep` first lets in-flight requests finish, and requests
that arrive meanwhile wait for it, then wake the engine again. Should the parked weights not come back (the file
gone), the engine is rebuilt from the model's source instead, as a new replica would load it.
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

from rayrunner.engines.base import Engine
from rayrunner.engines.parked_weights import ParkedWeights
from rayrunner.errors import ModelTimeoutError

logger = logging.getLogger(__name__)


class EngineSlot:
    def __init__(self, build: Callable[[], Engine], name: str) -> None:
        """`build` makes the engine (now, and again should its parked weights be lost); `name` names its file."""
        self._build = build
        self.engine: Engine = build()
        self._weights = ParkedWeights(name)
        self._asleep = False
        self._lock = asyncio.Lock()  # sleep and wake run alone; requests pass it to start
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.slept_at: float | None = None
        self.last_wake_s: float | None = None

    @property
    def asleep(self) -> bool:
        return self._asleep

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[Engine]:
        """The engine for one request (woken first if asleep), held until the request ends."""
        async with self._lock:
            if self.asleep:
                await self._wake()
            engine = self.engine
            self._active += 1
            self._idle.clear()
        try:
            yield engine
        finally:
            self._active -= 1
            if not self._active:
                self._idle.set()

    async def sleep(self, drain_timeout_s: float) -> None:
        """Park the weights once in-flight requests are done (new ones wait, then wake the engine)."""
        async with self._lock:
            if self.asleep:
                return
            try:
                await asyncio.wait_for(self._idle.wait(), drain_timeout_s)
            except TimeoutError:
                raise ModelTimeoutError(
                    f"requests still running after {drain_timeout_s:.0f} s: not put to sleep") from None
            await self.engine.sleep(self._weights)
            self._asleep = True
            _free_memory()
            self.slept_at = time.time()

    async def wake(self) -> None:
        async with self._lock:
            if self.asleep:
                await self._wake()

    async def _wake(self) -> None:
        start = time.perf_counter()
        try:
            await self.engine.wake(self._weights)
        except Exception:
            logger.exception("the parked weights did not come back: loading the model again")
            await self._rebuild()
        self._asleep = False
        self.last_wake_s = time.perf_counter() - start
        self.slept_at = None
        logger.info("woke up in %.2f s", self.last_wake_s)

    async def _rebuild(self) -> None:
        """A new engine in place of the one whose weights are lost (which stays, parked, if this fails too)."""
        engine = await asyncio.to_thread(self._build)
        old, self.engine = self.engine, engine
        await asyncio.to_thread(old.close)
        self._weights.discard()
        self._weights = ParkedWeights(self._weights.name)

    def state(self) -> dict[str, Any]:
        return {"asleep": self.asleep, "slept_at": self.slept_at, "last_wake_s": self.last_wake_s}

    def close(self) -> None:
        self.engine.close()
        self._weights.discard()


def _free_memory() -> None:
    """Collect the dropped tensors' cycles now, hand freed heap pages back to the OS (glibc keeps freed blocks of
    the sizes torch allocates in its arenas otherwise), and return the accelerator's cached blocks."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
