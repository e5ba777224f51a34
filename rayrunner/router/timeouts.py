"""The router's `request_timeout_s`: a unary call, a stream's opening, and a stream as a whole run within it; past
it the request's work is cancelled and the caller gets a 408 (`request_timeout`), in-band for a started stream."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

from rayrunner.errors import RequestTimeoutError


def _expired(timeout_s: float) -> RequestTimeoutError:
    return RequestTimeoutError(f"the request took longer than this service allows ({timeout_s:g} s)")


def deadline(timeout_s: float | None) -> tuple[float, float] | None:
    """(monotonic deadline, the timeout) for `until`; None without a timeout."""
    return None if timeout_s is None else (time.monotonic() + timeout_s, timeout_s)


@contextlib.asynccontextmanager
async def within(timeout_s: float | None) -> AsyncIterator[None]:
    """Cancel the block's work after `timeout_s` (None: never) and raise RequestTimeoutError instead."""
    if timeout_s is None:
        yield
        return
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except TimeoutError:
        raise _expired(timeout_s) from None


async def until(limit: tuple[float, float] | None, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`stream`, ended by RequestTimeoutError once the deadline passes (the model's stream is closed with it)."""
    if limit is None:
        async for item in stream:
            yield item
        return
    end, timeout_s = limit
    iterator = aiter(stream)
    try:
        while True:
            try:
                item = await asyncio.wait_for(anext(iterator), max(0.0, end - time.monotonic()))
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise _expired(timeout_s) from None
            yield item
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()
