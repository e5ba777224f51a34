"""The registry's lifecycle logic in process, against an in-memory `ModelApps` (no cluster): single-flight loads,
failures, unload modes, eviction, keep_alive, remove races, reconciliation with what already runs, and an edited
config applied over a saved state (over Serve: integration/test_serve_config.py)."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rayrunner.errors import (
    CapacityError,
    ModelAlreadyLoadedError,
    ModelAlreadyUnloadedError,
    ModelLoadError,
    ModelNotFoundError,
    ModelReloadingError,
)
from rayrunner.registry.actor import Registry
from tests.fake_model_apps import FakeModelApps

SMOLLM2 = {"type": "plain", "model_id": "smollm2-135m-instruct"}


def entry(model_id: str, load: bool = False, **extra: Any) -> dict[str, Any]:
    return {"spec": {"model_id": model_id, "which": SMOLLM2}, "load": load, **extra}


async def registry(tmp_path: Path, apps: FakeModelApps, models: list[dict[str, Any]], **config: Any) -> Registry:
    found = Registry(str(tmp_path / "registry.json"), apps=apps)
    await found.bootstrap({"models": models, **config})
    return found


def app(registry: Registry, model_id: str) -> str:
    return registry.state.models[model_id].spec.app_name


async def test_concurrent_requests_share_one_load(tmp_path: Path) -> None:
    apps = FakeModelApps(start_s=0.05)
    reg = await registry(tmp_path, apps, [entry("a")])
    assert await reg.status("a") == "unloaded"
    loaded = await asyncio.gather(*(reg.ensure_loaded("a") for _ in range(8)))
    assert loaded == ["a"] * 8
    assert apps.deploys(app(reg, "a")) == 1
    assert await reg.status("a") == "loaded"


async def test_conflicting_lifecycle_calls_raise_what_the_api_answers_409_and_404(tmp_path: Path) -> None:
    """The errors the router maps to 409 (`model_already_unloaded`, `model_already_loaded`, `model_reloading`) and
    404 (`model_not_found`); a second reload while one runs does not start a second load (over HTTP:
    integration/test_lifecycle.py)."""
    apps = FakeModelApps(start_s=0.3)
    reg = await registry(tmp_path, apps, [entry("a", load=True), entry("b")])
    await reg.ensure_loaded("a")
    with pytest.raises(ModelAlreadyUnloadedError):
        await reg.unload("b")
    with pytest.raises(ModelAlreadyLoadedError):
        await reg.reload("a")
    for call in (reg.unload("nope"), reg.reload("nope"), reg.status("nope"), reg.remove("nope"),
                 reg.set_default("nope")):
        with pytest.raises(ModelNotFoundError):
            await call
    first = asyncio.create_task(reg.reload("b"))
    while await reg.status("b") != "reloading":
        await asyncio.sleep(0.01)
    with pytest.raises(ModelReloadingError):
        await reg.reload("b")
    await first
    assert await reg.status("b") == "loaded" and apps.deploys(app(reg, "b")) == 1


async def test_a_failed_load_leaves_the_model_unloaded_with_its_error(tmp_path: Path) -> None:
    apps = FakeModelApps(failing={"a"})
    reg = await registry(tmp_path, apps, [entry("a")])
    with pytest.raises(ModelLoadError):
        await reg.ensure_loaded("a")
    card = await reg.card("a")
    assert card["status"] == "unloaded" and "failed to start" in card["last_error"]
    assert ("delete", app(reg, "a")) in apps.calls  # no half-started app is left
    apps.failing.clear()
    assert await reg.ensure_loaded("a") == "a"  # and the next request loads it


async def test_unload_stop_scales_to_zero_and_sleep_keeps_the_replica(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("a", load=True)])
    await reg.ensure_loaded("a")
    await reg.unload("a", "sleep")
    assert ("sleep", app(reg, "a")) in apps.calls and await reg.status("a") == "unloaded"
    await reg.ensure_loaded("a")
    assert ("wake", app(reg, "a")) in apps.calls and apps.deploys(app(reg, "a")) == 1  # woken, not redeployed
    await reg.unload("a", "stop")
    assert ("scale_to_zero", app(reg, "a")) in apps.calls
    assert (await reg.card("a"))["unloaded_reason"] == "user"


async def test_max_loaded_models_evicts_the_least_recently_used(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("a"), entry("b"), entry("c")], max_loaded_models=2)
    await reg.ensure_loaded("a")
    await reg.ensure_loaded("b")
    await reg.ensure_loaded("a")  # a is now the more recently used
    await reg.ensure_loaded("c")
    statuses = {mid: await reg.status(mid) for mid in "abc"}
    assert statuses == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert (await reg.card("b"))["unloaded_reason"].startswith("evicted")


async def test_a_pinned_model_is_not_evicted(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("a", pinned=True), entry("b"), entry("c")], max_loaded_models=2)
    for model_id in "abc":
        await reg.ensure_loaded(model_id)
    assert [await reg.status(mid) for mid in "abc"] == ["loaded", "unloaded", "loaded"]


async def test_a_model_hosting_a_pinned_lora_model_is_not_evicted(tmp_path: Path) -> None:
    """A LoRA model is served by its base's replica, so pinning it keeps that base loaded."""
    apps = FakeModelApps()
    (tmp_path / "adapter").mkdir()
    lora = {"spec": {"model_id": "tuned", "which": {"type": "lora", "model_id": SMOLLM2["model_id"],
                                                    "adapter": str(tmp_path / "adapter")}}, "pinned": True}
    reg = await registry(tmp_path, apps, [entry("a"), lora, entry("b"), entry("c")], max_loaded_models=2)
    assert reg.state.host_of("tuned") == "a"
    for model_id in "abc":  # a is the least recently used
        await reg.ensure_loaded(model_id)
    assert [await reg.status(mid) for mid in "abc"] == ["loaded", "unloaded", "loaded"]


async def test_keep_alive_unloads_an_idle_model(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("a", keep_alive="0.2s")])
    await reg.ensure_loaded("a")
    for _ in range(100):
        if await reg.status("a") == "unloaded":
            break
        await asyncio.sleep(0.05)
    assert (await reg.card("a"))["unloaded_reason"] == "idle"


async def test_remove_waits_for_no_load_and_leaves_no_app(tmp_path: Path) -> None:
    """A remove during a load is refused (409, the load goes on); after it, the remove deletes the app."""
    apps = FakeModelApps(start_s=0.2)
    reg = await registry(tmp_path, apps, [entry("a"), entry("b")])
    name = app(reg, "a")
    load = asyncio.ensure_future(reg.ensure_loaded("a"))
    while await reg.status("a") != "reloading":  # until the load has begun
        await asyncio.sleep(0.01)
    with pytest.raises(ModelReloadingError):
        await reg.remove("a")
    assert await load == "a"
    await reg.remove("a")
    assert name not in apps.apps
    with pytest.raises(ModelNotFoundError):
        await reg.status("a")


async def test_a_restarted_registry_adopts_what_runs_and_keeps_what_was_unloaded(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("a", load=True), entry("b", load=True)])
    await reg.ensure_loaded("a")
    await reg.ensure_loaded("b")
    await reg.unload("b")
    again = Registry(str(tmp_path / "registry.json"), apps=apps)  # the same state file, the same apps
    assert await again.status("a") == "loaded" and await again.status("b") == "unloaded"
    assert apps.deploys(app(reg, "a")) == 1  # adopted, not redeployed
    saved = json.loads((tmp_path / "registry.json").read_text())
    assert set(saved["models"]) == {"a", "b"}


async def test_an_edited_config_wins_for_what_it_declares_and_runtime_changes_stay(tmp_path: Path) -> None:
    apps = FakeModelApps()
    models = [entry("m1", load=True, aliases=["one"]), entry("m2")]
    reg = await registry(tmp_path, apps, models, default_model="m1")
    await reg.ensure_loaded("m1")
    await reg.set_default("m2")  # runtime changes: a default, an alias, a model
    await reg.add_alias("m1", "uno")
    await reg.add(entry("extra"))
    edited = copy.deepcopy(models)
    edited[0]["spec"]["in_situ_quant"] = "Q8_0"
    again = await registry(tmp_path, apps, edited, default_model="m1")  # restarted, from the same file
    assert await again.ensure_loaded("m1") == "m1"
    assert apps.deploys(app(again, "m1")) == 2  # redeployed: it ran the spec the config replaced
    card = await again.card("m1")
    assert card["spec"]["in_situ_quant"] == "Q8_0" and card["aliases"] == ["one", "uno"]
    assert await again.default_id() == "m2"  # the config's default did not change: the runtime one stays
    assert await again.status("extra") == "unloaded"
    await again.bootstrap({"models": edited, "default_model": "one"})  # the same registry, a new default
    assert await again.default_id() == "m1"
    assert apps.deploys(app(again, "m1")) == 2  # an unchanged spec is not redeployed


async def test_without_a_model_of_its_kind_left_there_is_no_default(tmp_path: Path) -> None:
    embedding = {"spec": {"model_id": "emb", "which": {"type": "embedding", "model_id": "all-minilm-l6-v2"}},
                 "load": False}
    reg = await registry(tmp_path, FakeModelApps(), [entry("m1", load=True), entry("m2"), embedding],
                         default_model="m1")
    await reg.ensure_loaded("m1")  # a remove during the load is a 409 (test above)
    for model in ("m1", "m2"):
        await reg.remove(model)
    assert await reg.default_id() is None
    assert not (await reg.card("emb"))["is_default"]


async def test_with_only_pinned_models_in_the_way_a_load_waits_then_fails_with_no_room(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("a", load=True, pinned=True), entry("b")], max_loaded_models=1,
                         load_timeout_s=0.5)
    await reg.ensure_loaded("a")
    started = asyncio.get_running_loop().time()
    with pytest.raises(CapacityError) as raised:
        await reg.ensure_loaded("b")
    assert asyncio.get_running_loop().time() - started >= 0.5  # it waited for room first
    assert raised.value.status == 503 and raised.value.code == "capacity_exhausted" and raised.value.retry_after_s
    assert await reg.status("b") == "unloaded" and await reg.status("a") == "loaded"
    assert apps.deploys(app(reg, "b")) == 0


async def test_a_config_that_changes_only_the_replica_count_rescales_in_place(tmp_path: Path) -> None:
    apps = FakeModelApps()
    models = [entry("m1", load=True)]
    reg = await registry(tmp_path, apps, models)
    await reg.ensure_loaded("m1")
    models[0]["spec"]["engine"] = {"num_replicas": 2, "routing": "prefix"}
    await reg.bootstrap({"models": models})
    assert await reg.status("m1") == "loaded"  # never reloading: requests keep flowing
    for _ in range(500):  # until the rescale, which runs in the background, has deployed
        if apps.deploys(app(reg, "m1")) == 2:
            break
        await asyncio.sleep(0.01)
    assert apps.deploys(app(reg, "m1")) == 2 and ("delete", app(reg, "m1")) not in apps.calls
    assert reg.state.models["m1"].spec.engine.num_replicas == 2
    models[0]["spec"]["engine"] = {"num_replicas": 2, "max_num_seqs": 8}  # a setting replicas are built with
    await reg.bootstrap({"models": models})
    await reg.ensure_loaded("m1")
    assert ("delete", app(reg, "m1")) in apps.calls  # replaced: the old replicas go first


async def test_the_scale_call_saves_new_replica_settings_and_rescales_a_loaded_model(tmp_path: Path) -> None:
    apps = FakeModelApps()
    reg = await registry(tmp_path, apps, [entry("on", load=True), entry("off")])
    await reg.ensure_loaded("on")
    card = await reg.scale("on", {"num_replicas": 3})
    assert card["status"] == "loaded" and card["spec"]["engine"]["num_replicas"] == 3
    assert apps.deploys(app(reg, "on")) == 2 and ("delete", app(reg, "on")) not in apps.calls
    await reg.scale("off", {"autoscaling_config": {"max_replicas": 2}})
    assert apps.deploys(app(reg, "off")) == 0  # saved for its next load
    saved = json.loads((tmp_path / "registry.json").read_text())
    assert saved["models"]["off"]["spec"]["engine"]["autoscaling_config"]["max_replicas"] == 2


async def test_a_spec_that_cannot_be_read_back_is_logged_and_redeployed(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """A running app whose deployed spec cannot be read is redeployed over (the config's spec wins), and the
    cause is logged, not swallowed."""

    class Unreadable(FakeModelApps):
        async def deployed_args(self, app: str) -> dict[str, Any] | None:
            raise RuntimeError("serve status unavailable")

    apps = Unreadable()
    models = [entry("m1", load=True)]
    reg = await registry(tmp_path, apps, models)
    await reg.ensure_loaded("m1")
    edited = copy.deepcopy(models)
    edited[0]["spec"]["in_situ_quant"] = "Q8_0"
    with caplog.at_level("WARNING", logger="rayrunner"):
        again = await registry(tmp_path, apps, edited)
        assert await again.ensure_loaded("m1") == "m1"
    assert apps.deploys(app(again, "m1")) == 2
    assert any("cannot read the spec its app runs" in r.getMessage() and r.exc_info for r in caplog.records)


async def test_a_failed_load_whose_app_cannot_be_deleted_is_logged_and_not_stuck(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A load that fails leaves the model `unloaded` with its error even when its app cannot be deleted; the
    delete's failure is logged, not swallowed, and the next request tries the load again."""

    class Undeletable(FakeModelApps):
        async def delete(self, app: str) -> None:
            raise RuntimeError("serve controller unreachable")

    apps = Undeletable(failing={"m1"})
    reg = await registry(tmp_path, apps, [entry("m1")])
    with caplog.at_level("WARNING", logger="rayrunner"), pytest.raises(ModelLoadError, match="failed to start"):
        await reg.ensure_loaded("m1")
    record = reg.state.models["m1"]
    assert record.status == "unloaded" and "failed to start" in (record.last_error or "")
    assert any("could not be deleted" in r.getMessage() and r.exc_info for r in caplog.records)
    apps.failing.clear()
    assert await reg.ensure_loaded("m1") == "m1"
