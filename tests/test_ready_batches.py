"""Coalescing a stream: what a slow reader gets in one batch, and that items, order, errors and closing hold."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from rayrunner.runtime.ready_batches import ready_batches


async def produced(count: int, pause_s: float = 0.0, error: Exception | None = None) -> AsyncIterator[int]:
    for item in range(count):
        await asyncio.sleep(pause_s)
        yield item
    if error is not None:
        raise error


async def test_a_reader_that_keeps_up_gets_one_item_per_batch() -> None:
    batches = [batch async for batch in ready_batches(produced(5, pause_s=0.01))]
    assert batches == [[0], [1], [2], [3], [4]]


async def test_a_slow_reader_gets_what_piled_up_in_one_batch() -> None:
    batches = []
    async for batch in ready_batches(produced(50)):
        batches.append(batch)
        await asyncio.sleep(0.01)  # a slow client: the source runs ahead meanwhile
    assert [item for batch in batches for item in batch] == list(range(50))
    assert len(batches) < 5


async def test_an_error_comes_after_the_items_before_it() -> None:
    seen: list[int] = []
    with pytest.raises(ValueError, match="boom"):
        async for batch in ready_batches(produced(3, error=ValueError("boom"))):
            seen.extend(batch)
    assert seen == [0, 1, 2]


async def test_closing_the_batches_closes_the_source() -> None:
    closed = asyncio.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            while True:
                await asyncio.sleep(0.001)
                yield 1
        finally:
            closed.set()

    batches = ready_batches(endless())
    assert await anext(batches)
    await batches.aclose()  # type: ignore[attr-defined]
    assert closed.is_set()
