"""The workload of `bench_many_models.py`, pure and seeded: which model each request wants (Zipf popularity or
uniform), when it arrives (Poisson, Gamma with a given coefficient of variation, or a replay of the Azure LLM
inference trace 2023's arrivals and lengths), and the swaps an offline optimum (Belady) and plain LRU would make
on the same sequence with room for `k` models.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

TRACE = Path(__file__).parent / "traces" / "azure_llm_conv_2023_slice.csv"
ARRIVALS = ("poisson", "gamma2", "gamma4", "azure")


@dataclass(frozen=True)
class Request:
    at: float  # seconds after the start
    model: str
    prompt_tokens: int  # about how long the prompt is
    max_tokens: int


def popularity(models: list[str], zipf_s: float) -> list[float]:
    """Each model's share of requests: Zipf with exponent `zipf_s` over the given order (0: uniform)."""
    weights = [1.0 / (rank + 1) ** zipf_s for rank in range(len(models))]
    total = sum(weights)
    return [w / total for w in weights]


def arrival_times(kind: str, rate: float, duration_s: float, rng: random.Random) -> list[tuple[float, int, int]]:
    """(time, prompt tokens, generated tokens) of each arrival within `duration_s` at `rate` requests/s on
    average. Poisson and Gamma draw their gaps; `azure` replays the trace's gaps scaled to `rate` and its lengths."""
    if kind == "azure":
        return _replayed(rate, duration_s)
    cv = {"poisson": 1.0, "gamma2": 2.0, "gamma4": 4.0}[kind]
    shape = 1.0 / cv**2  # a Gamma of this shape and mean 1/rate has the coefficient of variation `cv`
    times, now = [], 0.0
    while True:
        now += rng.gammavariate(shape, 1.0 / (rate * shape))
        if now >= duration_s:
            return times
        times.append((now, 0, 0))


def _replayed(rate: float, duration_s: float) -> list[tuple[float, int, int]]:
    with TRACE.open() as handle:
        rows = [(datetime.fromisoformat(r["TIMESTAMP"][:26]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(handle)]
    start = rows[0][0]
    offsets = [(at - start).total_seconds() for at, _, _ in rows]
    scale = (len(rows) / offsets[-1]) / rate  # the trace's own rate, brought to the one asked for
    replayed, lap = [], 0.0
    while True:  # the slice again after its end, until the duration is filled
        for offset, (_, prompt, generated) in zip(offsets, rows, strict=True):
            at = lap + offset * scale
            if at >= duration_s:
                return replayed
            replayed.append((at, prompt, generated))
        lap += offsets[-1] * scale


def workload(models: list[str], zipf_s: float, kind: str, rate: float, duration_s: float, seed: int,
             max_tokens: int, max_prompt_tokens: int = 256) -> list[Request]:
    """The requests of one run: arrivals of `kind`, each for a model drawn by popularity. Lengths from the trace
    are capped (`max_tokens`, `max_prompt_tokens`) so a run on a small CPU box measures swaps, not long decodes."""
    rng = random.Random(seed)
    shares = popularity(models, zipf_s)
    return [Request(at, rng.choices(models, shares)[0], min(prompt, max_prompt_tokens) if prompt else 32,
                    min(generated, max_tokens) if generated else max_tokens)
            for at, prompt, generated in arrival_times(kind, rate, duration_s, rng)]


def belady_loads(sequence: list[str], k: int) -> int:
    """Loads the offline optimum makes serving `sequence` with room for `k` (it evicts the model needed furthest
    in the future); the first load of each model counts."""
    resident: set[str] = set()
    loads = 0
    for i, model in enumerate(sequence):
        if model in resident:
            continue
        loads += 1
        if len(resident) >= k:
            resident.remove(max(resident, key=lambda m: _next_use(sequence, i + 1, m)))
        resident.add(model)
    return loads


def lru_loads(sequence: list[str], k: int) -> int:
    """Loads plain LRU makes on `sequence` with room for `k` (for reference beside the measured policies)."""
    resident: list[str] = []
    loads = 0
    for model in sequence:
        if model in resident:
            resident.remove(model)
        else:
            loads += 1
            if len(resident) >= k:
                resident.pop(0)
        resident.append(model)
    return loads


def _next_use(sequence: list[str], start: int, model: str) -> int:
    try:
        return sequence.index(model, start)
    except ValueError:
        return len(sequence)
