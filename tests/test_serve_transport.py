"""The transport switch: gRPC channels by default, Ray actor calls with `RAYRUNNER_SERVE_GRPC=0`."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest

from rayrunner import serve_transport


class _Handle:
    def options(self, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        return "with options", kwargs


@pytest.fixture
def reloaded(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    def reload(value: str | None) -> Any:
        if value is None:
            monkeypatch.delenv(serve_transport.SWITCH, raising=False)
        else:
            monkeypatch.setenv(serve_transport.SWITCH, value)
        return importlib.reload(serve_transport)

    yield reload
    monkeypatch.delenv(serve_transport.SWITCH, raising=False)
    importlib.reload(serve_transport)


def test_grpc_by_default(reloaded: Any) -> None:
    module = reloaded(None)
    assert module.CLUSTER_ENV["RAY_SERVE_PROXY_USE_GRPC"] == "1"
    assert module.direct(_Handle()) == ("with options", {"_by_reference": False})
    assert int(module.REPLICA_ENV["RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH"]) > 4 * 1024 * 1024


def test_switched_off_keeps_actor_calls(reloaded: Any) -> None:
    module = reloaded("0")
    handle = _Handle()
    assert module.CLUSTER_ENV["RAY_SERVE_PROXY_USE_GRPC"] == "0" and module.direct(handle) is handle
