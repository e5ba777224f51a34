"""Shapes of the admin API: registry cards as OpenAI model objects, and add-model bodies as registry entries."""

from __future__ import annotations

from typing import Any

from rayrunner.models.spec import build_spec
from rayrunner.protocol import AddModelBody


def model_object(card: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI model object plus rayrunner's fields (status, aliases, default, spec, load facts)."""
    info = card.get("info") or {}
    spec = card["spec"]
    return {
        "id": card["model_id"],
        "object": "model",
        "created": int(card["registered_at"]),
        "owned_by": "rayrunner",
        "status": card["status"],
        "phase": card.get("phase"),  # the lifecycle phase behind the status (rayrunner/registry/lifecycle.py)
        "aliases": card["aliases"],
        "is_default": card["is_default"],
        "kind": card["kind"],
        "spec": spec,
        "loaded_at": card["loaded_at"],
        "last_error": card["last_error"],
        "load_count": card["load_count"],
        "device": info.get("device"),
        "dtype": info.get("dtype"),
        "weight_bytes": info.get("weight_bytes"),
        "quantization": info.get("quantization"),
        "pinned": card["pinned"],
        "keep_alive": card["keep_alive"],
        "last_used_at": card["last_used_at"],
        "unloaded_reason": card["unloaded_reason"],
        "load_seconds": card["load_seconds"],
        "estimated_bytes": card["estimated_bytes"],
        "in_flight": card["in_flight"],
        "unload_mode": card["unload_mode"] if card["status"] == "unloaded" else None,
        "held_bytes": info.get("process_rss_bytes") if card["status"] == "unloaded" else None,
        "load_progress": card.get("load_progress"),  # while `reloading`: the phase the replica is in
        "replicas": card.get("replicas"),  # running, starting and Serve's target
    }


def status_of(card: dict[str, Any]) -> dict[str, Any]:
    answer = {"model_id": card["model_id"], "status": card["status"]}
    if card["status"] == "unloaded" and card.get("unload_mode") == "sleep":
        answer["unload_mode"] = card["unload_mode"]
    return answer


def entry_from_add(body: AddModelBody) -> dict[str, Any]:
    """A registry entry; the spec is validated here so a bad one is a 400 before anything is registered."""
    spec = build_spec(body.model_id, body.which, body.in_situ_quant, body.engine)
    # `pinned: false` leaves a registered model as it is (an add of the same spec only attaches to it)
    return {"spec": spec.model_dump(mode="json"), "aliases": body.aliases, "load": body.load,
            "pinned": body.pinned or None, "keep_alive": body.keep_alive}
