"""The routing table: what the registry state publishes, and how a router replica's copy takes updates."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from rayrunner.models.spec import build_spec
from rayrunner.registry.state import RegistryState
from rayrunner.router.routes import RoutingTable


def state_with_two_models() -> RegistryState:
    state = RegistryState()
    state.add(build_spec("alpha", {"type": "plain", "model_id": "/models/a"}), ["a"])
    state.add(build_spec("org/beta", {"type": "embedding", "model_id": "/models/b"}), ["b", "bee"])
    return state


def test_routes_cover_ids_aliases_and_default_like_resolve() -> None:
    state = state_with_two_models()
    routes = state.routes()
    assert set(routes) == {"alpha", "a", "org/beta", "b", "bee", "default"}
    for name, route in routes.items():
        assert route == state.route(state.resolve(name))
    assert routes["bee"]["kind"] == "embedding" and routes["default"]["model_id"] == "alpha"
    state.set_default("b")
    assert state.routes()["default"]["model_id"] == "org/beta"


def test_no_default_route_without_a_default() -> None:
    state = state_with_two_models()
    state.remove("alpha")
    state.remove("org/beta")
    assert state.routes() == {}


class FakeRegistry:
    """Answers `routing_table` with whatever table the test sets (the long poll itself is the registry's)."""

    def __init__(self) -> None:
        self.table: dict[str, Any] = {}
        self.routing_table = SimpleNamespace(remote=self._answer)

    async def _answer(self, known: Any) -> dict[str, Any]:
        return self.table


def table(epoch: str, changes: int, model_id: str) -> dict[str, Any]:
    return {"version": [epoch, changes], "routes": {"default": {"model_id": model_id}}}


def test_copy_ignores_answers_older_than_what_it_holds() -> None:
    registry = FakeRegistry()
    routing = RoutingTable(registry)

    async def refresh_with(answer: dict[str, Any]) -> str | None:
        registry.table = answer
        await routing.refresh()
        route = routing.get("default")
        return route["model_id"] if route else None

    assert routing.get("default") is None
    assert asyncio.run(refresh_with(table("e1", 5, "new"))) == "new"
    assert asyncio.run(refresh_with(table("e1", 4, "old"))) == "new"  # a slower, older answer lost the race
    assert asyncio.run(refresh_with(table("e2", 1, "restarted"))) == "restarted"  # a new registry epoch wins
