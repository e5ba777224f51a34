"""Capacity's pure rules, no Ray: keep_alive durations, the eviction plan (LRU, reload cost as tie-breaker, pinned
and busy models kept), in-flight reports, and the byte estimate from a weights folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rayrunner.errors import ModelTooLargeError
from rayrunner.models.footprint import estimate_bytes
from rayrunner.models.keep_alive import idle_deadline, parse_keep_alive
from rayrunner.models.spec import build_spec
from rayrunner.protocol import ChatCompletionRequest
from rayrunner.registry.capacity import (
    EVICTED_BYTES,
    EVICTED_MODELS,
    IN_FLIGHT_TTL_S,
    InFlightBook,
    Limits,
    Occupant,
    plan_room,
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
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
              "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    kv = 2 * 2 * 2 * 16 * 128 * 2  # k and v, layers, kv heads, head dim, tokens, bf16
    weights = 100_100
    assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": str(tmp_path)})) == weights * 2 + kv
    f32 = build_spec("m", {"type": "plain", "model_id": str(tmp_path), "dtype": "f32"})
    assert estimate_bytes(f32) == weights * 4 + kv * 2
    assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": str(tmp_path)}, "Q8_0")) == weights + kv
    assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": str(tmp_path)}, "Q4K")) == weights // 2 + kv
    assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": str(tmp_path)}), 5000) == 5000 + kv
    assert estimate_bytes(build_spec("m", {"type": "plain", "model_id": "nobody/nothing"})) == 0
    budgeted = build_spec("m", {"type": "plain", "model_id": str(tmp_path)})
    budgeted.engine.kv_cache_bytes = 10_000_000
    assert estimate_bytes(budgeted) == weights * 2 + 10_000_000  # the KV budget, not one sequence's reserve


def test_python_entries_carry_pinned_and_keep_alive() -> None:
    from rayrunner.client import _entry

    entry = ModelEntry.model_validate(_entry("m", {"type": "plain", "model_id": "x"}, None, [], False,
                                             pinned=True, keep_alive="5m"))
    assert entry.pinned is True and entry.keep_alive == "5m"
    unpinned = ModelEntry.model_validate(_entry("m", {"type": "plain", "model_id": "x"}, None, [], False))
    assert unpinned.pinned is None and unpinned.keep_alive is None  # an add of a registered model keeps its own
