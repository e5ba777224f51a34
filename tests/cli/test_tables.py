"""`ps` rows from model objects: memory by status, markers and placeholders."""

from __future__ import annotations

from typing import Any

from rayrunner.cli.tables import COLUMNS, human_bytes, row


def model(**fields: Any) -> dict[str, Any]:
    base = {"id": "m", "status": "loaded", "kind": "text", "aliases": [], "is_default": False, "weight_bytes": 2048,
            "held_bytes": None, "unload_mode": None, "spec": {"in_situ_quant": None}, "in_flight": 0,
            "unloaded_reason": None, "last_error": None}
    return {**base, **fields}


def cells(fields: dict[str, Any]) -> dict[str, str]:
    return dict(zip(COLUMNS, row(fields), strict=True))


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (None, 0, 1023, 1536, 12_731_008, 3 * 1024**4)] == [
        "-", "0 B", "1023 B", "1.5 KiB", "12.1 MiB", "3.0 TiB"]


def test_memory_is_weights_when_loaded_held_bytes_when_sleeping_else_none() -> None:
    assert cells(model())["MEMORY"] == "2.0 KiB"
    sleeping = cells(model(status="unloaded", unload_mode="sleep", held_bytes=1024**2, unloaded_reason="user"))
    assert (sleeping["STATUS"], sleeping["MEMORY"], sleeping["UNLOADED"]) == ("unloaded (sleeping)", "1.0 MiB", "user")
    stopped = cells(model(status="unloaded", unload_mode="stop", unloaded_reason="idle"))
    assert (stopped["STATUS"], stopped["MEMORY"], stopped["UNLOADED"]) == ("unloaded", "-", "idle")
    assert cells(model(status="reloading"))["MEMORY"] == "-"


def test_a_load_waiting_for_room_says_so() -> None:
    assert cells(model(status="reloading", phase="waiting_for_room"))["STATUS"] == "reloading (waiting for room)"
    assert cells(model(status="reloading", phase="loading"))["STATUS"] == "reloading"


def test_default_aliases_quantization_and_a_long_error() -> None:
    found = cells(model(is_default=True, aliases=["a", "b"], spec={"in_situ_quant": "Q4K"}, in_flight=3,
                        last_error="x" * 200 + "\nsecond line"))
    assert (found["DEFAULT"], found["ALIASES"], found["QUANT"], found["IN FLIGHT"]) == ("*", "a, b", "Q4K", "3")
    assert found["LAST ERROR"] == "x" * 77 + "..."
    assert cells(model())["DEFAULT"] == "" and cells(model())["ALIASES"] == "-"


def test_a_loading_model_shows_its_phase() -> None:
    quantizing = {"phase": "quantizing", "detail": {"in_situ_quant": "Q8_0"}, "since": 0.0}
    assert cells(model(status="reloading", load_progress=quantizing))["STATUS"] == "reloading (quantizing)"
    downloading = {"phase": "downloading", "detail": {"bytes_done": 3 * 1024**2, "bytes_total": 12 * 1024**2},
                   "since": 0.0}
    assert cells(model(status="reloading", load_progress=downloading))["STATUS"] == \
        "reloading (downloading 3.0 MiB/12.0 MiB)"
    assert cells(model(status="reloading", load_progress=None))["STATUS"] == "reloading"  # its replica not started


def test_replicas_show_running_over_target_and_those_starting() -> None:
    assert cells(model(replicas={"running": 1, "starting": 1, "target": 2}))["REPLICAS"] == "1/2 (+1 starting)"
    assert cells(model(replicas={"running": 2, "starting": 0, "target": 2}))["REPLICAS"] == "2/2"
    assert cells(model())["REPLICAS"] == "-"
