"""Coalesce a stream: each batch is one item waited for plus every item already produced behind it.

A streamed reply crosses two hops as messages (replica -> router -> proxy), and each message costs the sender and
the receiver CPU on the node that also decodes. A reader that keeps up gets one item per batch, as before; one that
falls behind (a slow client, a busy event loop, several choices finishing a step at once) gets what piled up in one
message instead of one message per token, so it never makes the engine's node do more work per token. The items
themselves, their order and the end of the stream (or its error) are unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")


class _End:
    """The stream ended: `error` is what it raised (None at a clean end)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


async def ready_batches(items: AsyncIterator[T]) -> AsyncIterator[list[T]]:
    """`items` in batches of what was ready; the source runs ahead in a task and is closed when this one is."""
    queue: asyncio.Queue[T | _End] = asyncio.Queue()

    async def pump() -> None:
        try:
            async for item in items:
                queue.put_nowait(item)
        except Exception as exc:  # handed to the reader, in order
            queue.put_nowait(_End(exc))
        else:
            queue.put_nowait(_End())

    task = asyncio.ensure_future(pump())
    try:
        while True:
            batch: list[T] = []
            item = await queue.get()
            while not isinstance(item, _End):
                batch.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if batch:
                yield batch
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
