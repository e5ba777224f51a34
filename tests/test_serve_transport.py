"""The transport switch: gRPC channels by default, Ray actor calls with `RAYRUNNER_SERVE_GRPC=0`."""

from __future__ import annotations

import importlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rayrunner.runtime import transport as serve_transport


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


@pytest.mark.parametrize("switch", [None, "0"])
def test_the_shell_scripts_export_the_cluster_env(reloaded: Any, switch: str | None) -> None:
    """scripts/cluster_env.sh (sourced by install.sh and the cluster scripts) sets the environment the clusters
    rayrunner starts itself get (`warm_workers.CLUSTER_ENV`), the switch included."""
    from rayrunner.runtime import warm_workers

    module = reloaded(switch)
    expected = {**warm_workers.CLUSTER_ENV, **module.CLUSTER_ENV}  # the transport's part as `switch` makes it
    script = Path(__file__).parents[1] / "scripts" / "cluster_env.sh"
    env = {"PATH": os.environ["PATH"], **({} if switch is None else {module.SWITCH: switch})}
    done = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{script}"; env'], env=env,
                          capture_output=True, text=True, check=True)
    exported = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    assert {key: exported.get(key) for key in expected} == expected
