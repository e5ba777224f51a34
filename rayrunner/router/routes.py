"""A router replica's copy of the registry's routing table, so that a request needs no actor call to find its model.

The registry versions its state and answers `routing_table(known)` as a long poll: at once when `known` is stale,
otherwise at its next change. One background task per replica keeps that call outstanding, so the copy trails the
registry by about one actor round trip. Changes made through this replica are read back at once (`refresh`), so
its own callers never see their change missing. A name not in the copy (unknown, or before the first answer) is
resolved by the registry itself, which gives the authoritative 404.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

RETRY_S = 0.5  # pause before asking again after the registry failed (e.g. while it restarts)


class RoutingTable:
    def __init__(self, registry: Any) -> None:
        self._registry = registry
        self._routes: dict[str, dict[str, Any]] = {}
        self._version: tuple[str, int] | None = None
        self._follower: asyncio.Task[None] | None = None

    def get(self, name: str) -> dict[str, Any] | None:
        """The route for an id, alias or `default`: model_id, app_name, status, kind; None if not known here."""
        return self._routes.get(name)

    def start(self) -> None:
        """Start following the registry (call from the replica's event loop)."""
        if self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(self._follow())

    async def refresh(self) -> None:
        """Read the current table now (after a change made through this replica)."""
        self._apply(await self._registry.routing_table.remote(None))

    async def _follow(self) -> None:
        while True:
            try:
                known = list(self._version) if self._version else None
                self._apply(await self._registry.routing_table.remote(known))
            except Exception as exc:
                logger.warning("routing table: registry unavailable (%s); asking it per request meanwhile", exc)
                self._routes, self._version = {}, None
                await asyncio.sleep(RETRY_S)

    def _apply(self, table: dict[str, Any]) -> None:
        epoch, changes = table["version"]
        if self._version is not None and self._version[0] == epoch and self._version[1] >= changes:
            return  # an answer older than what we hold (a long poll and a refresh crossed)
        self._version = (epoch, changes)
        self._routes = table["routes"]
