"""`rayrunner ps`: one row per model (like `ollama ps`), from the model objects of `GET /v1/models`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

COLUMNS = ("MODEL", "STATUS", "KIND", "ALIASES", "DEFAULT", "REPLICAS", "MEMORY", "QUANT", "IN FLIGHT", "UNLOADED",
           "LAST ERROR")
NONE = "-"
MAX_ERROR_CHARS = 80  # `ps --json` has the whole message


def human_bytes(count: int | None) -> str:
    """1,536 -> "1.5 KiB"; None -> "-"."""
    if count is None:
        return NONE
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def _sleeping(model: dict[str, Any]) -> bool:
    return model["status"] == "unloaded" and model.get("unload_mode") == "sleep"


def memory(model: dict[str, Any]) -> str:
    """The measured weight bytes of a loaded model; what a sleeping model's process still holds; else "-"."""
    if model["status"] == "loaded":
        return human_bytes(model.get("weight_bytes"))
    return human_bytes(model.get("held_bytes")) if _sleeping(model) else NONE


def status(model: dict[str, Any]) -> str:
    """The status, with what a loading model is doing ("reloading (quantizing)", "reloading (downloading
    1.2 GiB/3.4 GiB)") and whether an unloaded one sleeps."""
    if _sleeping(model):
        return "unloaded (sleeping)"
    if model.get("phase") == "waiting_for_room":
        return "reloading (waiting for room)"
    progress = model.get("load_progress")
    if model["status"] != "reloading" or not progress:
        return str(model["status"])
    detail = progress.get("detail") or {}
    if "bytes_done" in detail:
        done, total = human_bytes(detail["bytes_done"]), human_bytes(detail.get("bytes_total"))
        return f"reloading ({progress['phase']} {done}/{total})"
    return f"reloading ({progress['phase']})"


def replicas(model: dict[str, Any]) -> str:
    """`running/target`, with the replicas still starting: "1/2 (+1 starting)"; "-" when unknown."""
    counts = model.get("replicas")
    if not counts:
        return NONE
    starting = f" (+{counts['starting']} starting)" if counts.get("starting") else ""
    return f"{counts['running']}/{counts['target']}{starting}"


def _short(text: str | None) -> str:
    if not text:
        return NONE
    line = text.strip().splitlines()[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def row(model: dict[str, Any]) -> list[str]:
    """The cells of one model's row, in COLUMNS order."""
    return [
        model["id"],
        status(model),
        model.get("kind") or NONE,
        ", ".join(model.get("aliases") or []) or NONE,
        "*" if model.get("is_default") else "",
        replicas(model),
        memory(model),
        (model.get("spec") or {}).get("in_situ_quant") or NONE,
        str(model.get("in_flight") or 0),
        (model.get("unloaded_reason") or NONE) if model["status"] == "unloaded" else NONE,
        _short(model.get("last_error")),
    ]


def print_models(models: list[dict[str, Any]], console: Console) -> None:
    """The `ps` table, or a line saying there is no model."""
    if not models:
        console.print("no models")
        return
    table = Table(*COLUMNS, box=None, pad_edge=False, header_style="bold")
    for model in models:
        table.add_row(*row(model))
    console.print(table)
