"""A router replica's count of open requests per model, reported to the registry in batches.

The registry needs three facts for capacity and keep_alive: which models have requests in flight (never evicted),
when each was last used, and how many requests each got (how often it is wanted). Counting happens here, where
requests start and end, at no cost to the request; a background task sends what changed in one `report_usage`
call, at once after a quiet spell and then at most every `REPORT_S`, and re-sends every `HEARTBEAT_S` while
requests are open (the registry forgets a silent router's counts after `capacity.IN_FLIGHT_TTL_S`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from typing import Any

logger = logging.getLogger(__name__)

REPORT_S = 0.5
HEARTBEAT_S = 3.0


class UsageTracker:
    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self._router_id = uuid.uuid4().hex
        self._open: collections.Counter[str] = collections.Counter()
        self._used: dict[str, tuple[float, Any, int]] = {}  # last use, its keep_alive, requests begun
        self._keep_alive: dict[str, Any] = {}  # each model's latest request's own keep_alive
        self._changed = asyncio.Event()
        self._reporter: asyncio.Task[None] | None = None

    def begin(self, model_id: str, keep_alive: Any = None) -> None:
        """A request for `model_id` starts; `keep_alive` is its own (None: the model's)."""
        self._open[model_id] += 1
        self._keep_alive[model_id] = keep_alive
        self._touch(model_id, begun=1)

    def end(self, model_id: str) -> None:
        self._open[model_id] -= 1
        if self._open[model_id] <= 0:
            del self._open[model_id]
        self._touch(model_id)

    def _touch(self, model_id: str, begun: int = 0) -> None:
        earlier = self._used.get(model_id, (0.0, None, 0))[2]
        self._used[model_id] = (time.time(), self._keep_alive.get(model_id), earlier + begun)
        self._changed.set()
        if self._reporter is None:
            self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            timeout = HEARTBEAT_S if self._open else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)
            self._changed.clear()
            used, self._used = self._used, {}
            try:
                await self._registry.report_usage.remote(self._router_id, dict(self._open), used)
            except Exception as exc:  # e.g. the registry restarts: sent again with the next report
                logger.warning("usage report to the registry failed: %s", exc)
                self._used = {m: _merged(used.get(m), self._used.get(m)) for m in used.keys() | self._used.keys()}
            await asyncio.sleep(REPORT_S)


def _merged(old: tuple[float, Any, int] | None, new: tuple[float, Any, int] | None) -> tuple[float, Any, int]:
    """A use not reported (its report failed) and the uses since: the latest use, every request begun."""
    if old is None or new is None:
        return old or new  # type: ignore[return-value]  # never both None
    return new[0], new[1], old[2] + new[2]
