"""One service serving SmolLM2 (alias `smol`, the default) for every module of this package: the OpenAI surface,
its clients and the scheduler seen over HTTP need the same model and router config, so they share one deploy and
one load instead of one per module. Tests here leave the service as they found it (extra models removed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import Service, model_entry

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="package")
def service(cluster: dict[str, Any]) -> Iterator[Service]:
    config = {"models": [model_entry(MODEL, MODEL, aliases=["smol"])],
              "state_path": str(cluster["state_dir"] / "smollm2.json")}
    svc = Service(cluster, config)
    svc.wait_loaded(MODEL, timeout_s=180)
    yield svc
    svc.close()
