"""Capacity's pure rules, no Ray: keep_alive durations, the eviction plan (LRU, reload cost as tie-breaker, pinned
and busy models kept, models of unknown size), in-flight reports, the byte estimate from a weights folder and the
default KV budget it counts (on a GPU: the replica's share of the device)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rayrunner.errors import ModelLoadError, ModelTooLargeError
from rayrunner.models.footprint import (
    CPU_KV_BYTES,
    GPU_KV_FRACTION,
    estimate_bytes,
    expected_weight_bytes,
    gpu_kv_budget,
    replica_measures,
)
from rayrunner.models.keep_alive import idle_deadline, parse_keep_alive
from rayrunner.models.spec import ModelSpec, build_spec
from rayrunner.protocol import ChatCompletionRequest
from rayrunner.registry.eviction_rules import (
    EVICTED_BYTES,
    EVICTED_MODELS,
    IN_FLIGHT_TTL_S,
    USE_HALF_LIFE_S,
    InFlightBook,
    Limits,
    Occupant,
    decayed_uses,
    plan_room,
    reload_cost,
    unknown_bytes,
)
from rayrunner.registry.state import ModelEntry


@pytest.mark.parametrize(("value", "seconds"), [
    ("5m", 300.0), ("30s", 30.0), ("1h30m", 5400.0), ("250ms", 0.25), ("1.5m", 90.0), (" 10s ", 10.0),
    (45, 45.0), (2.5, 2.5), ("12", 12.0), (0, 0.0), ("0", 0.0), ("0s", 0.0),
    (-1, math.inf), ("-1", math.inf), ("-5m", math.inf),
])
def test_keep_alive_forms(value: str | float, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["", "5 minutes", "m5", "5x", "nan", True, "1h 30m"])
def test_keep_alive_rejects_what_is_not_a_duration(value: str | bool) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def test_keep_alive_is_checked_where_it_is_accepted() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest(messages=messages, keep_alive="3s").keep_alive == "3s"
    with pytest.raises(ValueError, match="keep_alive"):
        ChatCompletionRequest(messages=messages, keep_alive="soon")
    spec = {"model_id": "m", "which": {"type": "plain", "model_id": "x"}}
    assert ModelEntry.model_validate({"spec": spec, "keep_alive": -1, "pinned": True}).pinned
    with pytest.raises(ValueError):
        ModelEntry.model_validate({"spec": spec, "keep_alive": "later"})


def test_idle_deadline() -> None:
    assert idle_deadline(100.0, "3s") == 103.0
    assert idle_deadline(100.0, 0) == 100.0
    assert idle_deadline(100.0, None) is None  # no keep_alive: loaded until evicted or unloaded
    assert idle_deadline(100.0, -1) is None


def test_least_recently_used_goes_first() -> None:
    occupants = [Occupant("a", last_used=30.0), Occupant("b", last_used=10.0), Occupant("c", last_used=20.0)]
    assert plan_room(Limits(max_models=3), occupants, 0).victims == [("b", EVICTED_MODELS)]
    assert plan_room(Limits(max_models=2), occupants, 0).victims == [("b", EVICTED_MODELS), ("c", EVICTED_MODELS)]
    assert plan_room(Limits(max_models=4), occupants, 0).victims == []


def test_the_model_wanted_least_often_for_its_reload_cost_goes_first() -> None:
    """A popular model used a while ago stays; of two wanted as often, the slower to bring back stays."""
    popular = Occupant("popular", last_used=1.0, load_seconds=1.0, uses=10.0)
    rare = Occupant("rare", last_used=9.0, load_seconds=1.0, uses=1.0)
    assert plan_room(Limits(max_models=2), [popular, rare], 0).victims == [("rare", EVICTED_MODELS)]
    slow = Occupant("slow", last_used=1.0, uses=2.0, reload_cost=reload_cost(7.0, evicted_to_sleep=False))
    fast = Occupant("fast", last_used=9.0, uses=2.0, reload_cost=reload_cost(1.2, evicted_to_sleep=False))
    assert plan_room(Limits(max_models=2), [slow, fast], 0).victims == [("fast", EVICTED_MODELS)]


def test_a_wake_costs_alike_and_cold_loads_by_their_power_of_two() -> None:
    assert reload_cost(30.0, evicted_to_sleep=True) == reload_cost(None, evicted_to_sleep=False) == 1.0
    assert reload_cost(7.0, evicted_to_sleep=False) == reload_cost(9.0, evicted_to_sleep=False) == 8.0
    assert reload_cost(0.1, evicted_to_sleep=False) == 0.5


def test_recent_uses_halve_every_half_life() -> None:
    assert decayed_uses(8.0, since=0.0, now=USE_HALF_LIFE_S) == 4.0
    assert decayed_uses(8.0, since=0.0, now=2 * USE_HALF_LIFE_S, new=1) == 3.0
    assert decayed_uses(0.0, since=5.0, now=5.0, new=2) == 2.0


def test_a_tie_evicts_the_cheaper_reload() -> None:
    occupants = [Occupant("slow", last_used=5.0, load_seconds=40.0), Occupant("fast", last_used=5.0, load_seconds=2.0)]
    assert plan_room(Limits(max_models=2), occupants, 0).victims == [("fast", EVICTED_MODELS)]


def test_pinned_and_busy_models_stay_and_can_block() -> None:
    kept = Occupant("busy", last_used=1.0, evictable=False)
    plan = plan_room(Limits(max_models=2), [kept, Occupant("idle", last_used=9.0)], 0)
    assert plan.victims == [("idle", EVICTED_MODELS)] and not plan.blocked
    blocked = plan_room(Limits(max_models=2), [kept, Occupant("pinned", evictable=False)], 0)
    assert blocked.blocked and blocked.victims == []


def test_bytes_limit_evicts_until_the_new_model_fits() -> None:
    occupants = [Occupant("big", bytes=600, last_used=2.0), Occupant("small", bytes=300, last_used=1.0)]
    limits = Limits(max_bytes=1000)
    assert plan_room(limits, occupants, 100).victims == []
    assert plan_room(limits, occupants, 200).victims == [("small", EVICTED_BYTES)]
    assert plan_room(limits, occupants, 500).victims == [("small", EVICTED_BYTES), ("big", EVICTED_BYTES)]
    with pytest.raises(ModelTooLargeError) as raised:
        plan_room(limits, [], 1001)
    assert raised.value.status == 400 and raised.value.code == "model_too_large"


def test_in_flight_reports_replace_and_expire() -> None:
    book = InFlightBook()
    book.report("r1", {"a": 2, "b": 0}, now=0.0)
    book.report("r2", {"a": 1}, now=0.0)
    assert book.count("a", 1.0) == 3 and book.count("b", 1.0) == 0
    book.report("r1", {}, now=2.0)
    assert book.count("a", 2.0) == 1
    assert book.count("a", IN_FLIGHT_TTL_S + 0.5) == 0  # r2 went silent: its count no longer holds models


def test_byte_estimate_reads_the_safetensors_header(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(1000, 100, dtype=torch.float32), "b": torch.zeros(100)}, tmp_path / "m.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    weights = 100_100

    def spec(isq: str | None = None, **which: str) -> ModelSpec:
        return build_spec("m", {"type": "plain", "model_id": str(tmp_path), **which}, isq)

    kv = CPU_KV_BYTES  # the default budget a CPU replica takes, counted whether it is set or not
    assert estimate_bytes(spec()) == weights * 2 + kv
    assert estimate_bytes(spec(dtype="f32")) == weights * 4 + kv
    assert estimate_bytes(spec("Q8_0")) == weights + kv
    assert estimate_bytes(spec("Q4K")) == weights // 2 + kv
    assert estimate_bytes(spec(), 5000) == 5000 + kv
    budgeted = spec()
    budgeted.engine.kv_cache_bytes = 10_000_000
    assert estimate_bytes(budgeted) == weights * 2 + 10_000_000


def test_a_model_whose_weights_are_not_here_has_an_unknown_size(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="rayrunner"):
        assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": "nobody/nothing"})) is None
    assert any("`m`: size unknown" in r.getMessage() for r in caplog.records)
    # once a replica has loaded it, what it measured is the size
    assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": "nobody/nothing"}), 5000) == 5000 + CPU_KV_BYTES


def test_on_a_gpu_the_default_kv_budget_is_unknown_until_a_replica_reports_it(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(100, 10)}, tmp_path / "m.safetensors")
    (tmp_path / "config.json").write_text("{}")
    which = {"type": "plain", "model_id": str(tmp_path), "dtype": "f32"}
    gpu = build_spec("m", which, engine={"num_gpus": 0.5})
    assert estimate_bytes(gpu) is None
    assert estimate_bytes(gpu, None, 7_000) == 4000 + 7_000
    info = {"weight_bytes": 3000, "extra": {"scheduler": {"kv_cache_budget_bytes": 7_000}}}
    assert estimate_bytes(gpu, *replica_measures(info)) == 3000 + 7_000
    assert replica_measures({}) == (None, None)
    assert estimate_bytes(build_spec("m", which, engine={"num_gpus": 0.5, "kv_cache_bytes": 9_000})) == 4000 + 9_000
    assert estimate_bytes(build_spec("m", which, engine={"num_gpus": 0.5, "device": "cpu"})) == 4000 + CPU_KV_BYTES


def test_an_embedding_model_counts_no_kv() -> None:
    embedding = build_spec("e", {"type": "embedding", "model_id": "all-minilm-l6-v2"})
    assert estimate_bytes(embedding) == expected_weight_bytes(embedding) > 0


def test_the_gpu_budget_divides_the_device_among_the_replicas_sharing_it() -> None:
    """Each replica takes part of its share of the GPU beside its weights, whatever is free when it starts: the
    replicas on one GPU fit on it together, in any order."""
    total, weights = 100_000, 10_000
    first = gpu_kv_budget(total, free=total - weights, held=weights, share=0.5)
    second = gpu_kv_budget(total, free=total - 2 * weights, held=weights, share=0.5)  # starts second, same share
    assert first == second == int((total // 2 - weights) * GPU_KV_FRACTION)
    assert 2 * weights + first + second <= total
    quarters = [gpu_kv_budget(total, total, weights // 4, 0.25) for _ in range(4)]
    assert weights + sum(quarters) <= total
    assert gpu_kv_budget(total, total - weights, weights, 2.0) == int((total - weights) * GPU_KV_FRACTION)  # whole GPUs
    assert gpu_kv_budget(total, free=40_000, held=weights, share=0.0) == int(40_000 * GPU_KV_FRACTION)  # no share


def test_weights_that_fill_the_gpu_share_fail_the_load_naming_num_gpus() -> None:
    with pytest.raises(ModelLoadError) as raised:
        gpu_kv_budget(100_000, 80_000, held=30_000, share=0.25)
    assert raised.value.param == "num_gpus" and "no room for its KV cache" in str(raised.value)


def test_a_model_of_unknown_size_counts_as_the_largest_known_one() -> None:
    occupants = [Occupant("big", bytes=600, last_used=2.0), Occupant("small", bytes=300, last_used=1.0)]
    limits = Limits(max_bytes=1300)
    assert unknown_bytes(limits, [None, 600, 300]) == 600
    assert plan_room(limits, occupants, None).victims == [("small", EVICTED_BYTES)]  # as if it took 600
    assert plan_room(limits, [Occupant("unknown", bytes=None), Occupant("small", bytes=300)], 100).victims == []
    # nothing known: it counts as all of max_loaded_bytes and loads alone
    assert unknown_bytes(limits, [None, None]) == 1300
    assert plan_room(limits, [Occupant("a", bytes=None, last_used=1.0)], None).victims == [("a", EVICTED_BYTES)]
    assert plan_room(limits, [], None).victims == []
    # never past the limit, and never "too large": that is only known once a replica has measured it
    assert unknown_bytes(limits, [None, 5000]) == 1300
    assert plan_room(limits, [Occupant("huge", bytes=5000, evictable=False)], None).blocked


def test_python_entries_carry_pinned_and_keep_alive() -> None:
    from rayrunner.client import _entry

    entry = ModelEntry.model_validate(_entry("m", {"type": "plain", "model_id": "x"}, None, [], False,
                                             pinned=True, keep_alive="5m"))
    assert entry.pinned is True and entry.keep_alive == "5m"
    unpinned = ModelEntry.model_validate(_entry("m", {"type": "plain", "model_id": "x"}, None, [], False))
    assert unpinned.pinned is None and unpinned.keep_alive is None  # an add of a registered model keeps its own
