"""The router's usage counts as the registry receives them: open requests, last use, and requests begun."""

from __future__ import annotations

import asyncio
from typing import Any

from rayrunner.router.usage import UsageTracker


class Registry:
    """Receives `report_usage` calls as the registry actor's handle would carry them."""

    def __init__(self, fail: int = 0) -> None:
        self.reports: list[tuple[dict[str, int], dict[str, Any]]] = []
        self.fail = fail
        self.report_usage = self

    def remote(self, router_id: str, in_flight: dict[str, int], used: dict[str, Any]) -> Any:
        self.reports.append((in_flight, used))
        if self.fail:
            self.fail -= 1
            raise ConnectionError("registry restarting")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future


async def test_requests_begun_are_counted_once_each_and_survive_a_failed_report() -> None:
    registry = Registry(fail=1)
    usage = UsageTracker(registry)
    for _ in range(3):
        usage.begin("a")
    usage.end("a")
    while len(registry.reports) < 1:
        await asyncio.sleep(0.01)
    assert registry.reports[0][0] == {"a": 2} and registry.reports[0][1]["a"][2] == 3
    usage.begin("a")  # the failed report's three are sent again with this one
    while len(registry.reports) < 2:
        await asyncio.sleep(0.01)
    assert registry.reports[1][1]["a"][2] == 4
    usage.end("a")
    while len(registry.reports) < 3:
        await asyncio.sleep(0.01)
    assert registry.reports[2][0] == {"a": 2} and registry.reports[2][1]["a"][2] == 0
