"""`max_loaded_bytes` with models whose size the registry cannot tell before they load (a hub model not cached on
its machine, a GPU replica's default KV budget), in process against `tests/fake_model_apps.py`: an unknown size
counts as the largest known one, and once a replica has loaded, what it measured (weights, KV budget) is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rayrunner.models.footprint import CPU_KV_BYTES
from rayrunner.registry.actor import Registry
from tests.fake_model_apps import FakeModelApps

MEASURED_WEIGHTS = 1000  # what every fake replica reports


def hub_entry(model_id: str, **engine: Any) -> dict[str, Any]:
    return {"spec": {"model_id": model_id, "which": {"type": "plain", "model_id": f"nobody/{model_id}"},
                     "engine": engine}, "load": False}


class GpuApps(FakeModelApps):
    """Replicas that report the KV budget they took on their GPU."""

    async def info(self, app: str) -> dict[str, Any]:
        return {**await super().info(app), "extra": {"scheduler": {"kv_cache_budget_bytes": 5000}}}


async def test_a_hub_model_not_cached_here_counts_as_the_largest_known_model(tmp_path: Path) -> None:
    one = MEASURED_WEIGHTS + CPU_KV_BYTES  # a loaded replica: measured weights and the default CPU budget
    reg = Registry(str(tmp_path / "registry.json"), apps=FakeModelApps())
    await reg.bootstrap({"models": [hub_entry("a"), hub_entry("b")], "max_loaded_bytes": int(one * 1.5)})
    assert (await reg.card("a"))["estimated_bytes"] is None  # not 0: nothing here says how big it is
    await reg.ensure_loaded("a")  # nothing else loaded: it fits whatever its size
    assert (await reg.card("a"))["estimated_bytes"] == one
    await reg.ensure_loaded("b")  # unknown: counted as `a`, so both do not fit
    card = await reg.card("a")
    assert card["status"] == "unloaded" and card["unloaded_reason"] == "evicted: max_loaded_bytes"
    assert (await reg.card("b"))["estimated_bytes"] == one


async def test_a_gpu_model_counts_the_kv_budget_its_replica_took(tmp_path: Path) -> None:
    reg = Registry(str(tmp_path / "registry.json"), apps=GpuApps())
    await reg.bootstrap({"models": [hub_entry("g", num_gpus=0.5)], "max_loaded_bytes": 1 << 40})
    await reg.ensure_loaded("g")
    assert (await reg.card("g"))["estimated_bytes"] == MEASURED_WEIGHTS + 5000
