"""Ollama's `keep_alive`: how long a model stays loaded while idle, as a duration ("5m", "30s", "1h30m"), seconds,
or -1 for forever. Parsed here for the request and config models; the registry's idle timer asks `idle_deadline`."""

from __future__ import annotations

import math
import re
from typing import Any

KeepAlive = str | int | float | None
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


def parse_keep_alive(value: Any) -> float:
    """Ollama's `keep_alive` as seconds: a number of seconds, or a duration such as "5m", "30s", "1h30m", "-1";
    any negative value is forever (`math.inf`), 0 unloads right after each request. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError("keep_alive must be a duration such as \"5m\" or a number of seconds")
    seconds = float(value) if isinstance(value, int | float) else _parse_duration(str(value).strip())
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number")
    return math.inf if seconds < 0 else seconds


def _parse_duration(text: str) -> float:
    sign, body = (-1.0, text[1:]) if text.startswith("-") else (1.0, text)
    try:
        return sign * float(body)
    except ValueError:
        pass
    parts = _PART.findall(body)
    if not body or "".join(number + unit for number, unit in parts) != body:
        raise ValueError(f"keep_alive `{text}` is not a duration such as \"5m\", \"30s\", \"1h30m\" or -1")
    return sign * sum(float(number) * _UNITS[unit] for number, unit in parts)


def checked_keep_alive(value: KeepAlive) -> KeepAlive:
    """A pydantic validator: the value unchanged when it parses (None allowed)."""
    if value is not None:
        parse_keep_alive(value)
    return value


def idle_deadline(last_active: float, keep_alive: KeepAlive) -> float | None:
    """When a model idle since `last_active` is to be unloaded; None when it stays loaded."""
    if keep_alive is None:
        return None
    seconds = parse_keep_alive(keep_alive)
    return None if math.isinf(seconds) else last_active + seconds
