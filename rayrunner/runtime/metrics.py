"""rayrunner's metrics, through `ray.util.metrics`: exported by every node's Ray metrics agent in Prometheus format
(names prefixed `ray_`), so the Ray dashboard's Grafana and any Prometheus that scrapes Ray see them with no set-up
of their own. Every metric is labelled by `model` (a model id; names that resolve to none count as `unknown`, so
typos cannot grow the label set). `cluster/grafana/rayrunner.json` is a dashboard over them.

Ray's metrics agent drops a gauge's series two report intervals after its last `set` (20 s by default), so a value
set once (a model's status, its weight bytes, an idle batch's size) would vanish from the endpoint while still true.
Every gauge set here is held and set again by a daemon thread each half interval; a removed model's are let go.

Who records what: the registry (status, loads, unloads by reason, load seconds, weight bytes), each router replica
(requests by route and HTTP status), each model replica (time to first token, inter-token latency, tokens in and out,
running and queued sequences, and its own sequences by `replica`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

from ray.util import metrics

STATUSES = ("loaded", "unloaded", "reloading")
_LATENCY_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
_LOAD_S = [0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 900]


@functools.cache
def _counter(name: str, description: str, *tags: str) -> metrics.Counter:
    return metrics.Counter(name, description, tag_keys=("model", *tags))


@functools.cache
def _gauge(name: str, description: str, *tags: str) -> metrics.Gauge:
    return metrics.Gauge(name, description, tag_keys=("model", *tags))


@functools.cache
def _histogram(name: str, description: str, boundaries: tuple[float, ...]) -> metrics.Histogram:
    return metrics.Histogram(name, description, boundaries=list(boundaries), tag_keys=("model",))


class _HeldGauges:
    """The last value of every (gauge, tags) set in this process, set again every `period_s` so it stays exported."""

    def __init__(self) -> None:
        report_ms = os.environ.get("RAY_metrics_report_interval_ms", "10000")  # noqa: SIM112 (Ray's own name)
        interval_s = max(float(report_ms) / 1000, 1.0)
        self.period_s = interval_s / 2  # the agent keeps a value two intervals: one refresh may run late
        self._values: dict[tuple[str, frozenset[tuple[str, str]]], tuple[metrics.Gauge, float, dict[str, str]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def set(self, gauge: metrics.Gauge, value: float, tags: dict[str, str]) -> None:
        gauge.set(value, tags=tags)
        with self._lock:
            self._values[(gauge.info["name"], frozenset(tags.items()))] = (gauge, value, tags)
            if self._thread is None:
                self._thread = threading.Thread(target=self._refresh, name="rayrunner-gauges", daemon=True)
                self._thread.start()

    def forget_model(self, model: str) -> None:
        with self._lock:
            self._values = {key: held for key, held in self._values.items() if held[2].get("model") != model}

    def _refresh(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self._lock:
                held = list(self._values.values())
            for gauge, value, tags in held:
                gauge.set(value, tags=tags)


_held = _HeldGauges()


# ------------------------------------------------------------ registry


def model_status(model: str, status: str) -> None:
    """One gauge per (model, status): 1 for the model's status now, 0 for the others; `removed`: all 0, and the
    model's gauges are no longer held (its series leave the endpoint)."""
    gauge = _gauge("rayrunner_model_status", "1 for the model's current status (loaded, unloaded, reloading).",
                   "status")
    for each in STATUSES:
        _held.set(gauge, 1.0 if each == status else 0.0, {"model": model, "status": each})
    if status == "removed":
        _held.forget_model(model)


def model_phase(model: str, phase: str, phases: tuple[str, ...]) -> None:
    """One gauge per (model, phase of its lifecycle): 1 for the phase now (its tier: loaded, asleep, stopped, or
    waiting for room, loading, failed), 0 for the others."""
    gauge = _gauge("rayrunner_model_phase", "1 for the model's lifecycle phase now (asleep, stopped, waiting_for_room, "
                   "loading, loaded, failed).", "phase")
    for each in phases:
        _held.set(gauge, 1.0 if each == phase else 0.0, {"model": model, "phase": each})


def model_loaded(model: str, seconds: float, weight_bytes: int | None) -> None:
    _counter("rayrunner_model_loads", "Model loads, by result.", "result").inc(tags={"model": model, "result": "ok"})
    _histogram("rayrunner_model_load_seconds", "Seconds from the start of a load to the model serving.",
               tuple(_LOAD_S)).observe(seconds, tags={"model": model})
    if weight_bytes is not None:
        weights(model, weight_bytes)


def model_load_failed(model: str) -> None:
    _counter("rayrunner_model_loads", "Model loads, by result.", "result").inc(
        tags={"model": model, "result": "failed"})


def model_unloaded(model: str, reason: str, mode: str) -> None:
    """`reason`: user, idle, or `evicted: <limit>`; `mode`: stop or sleep."""
    _counter("rayrunner_model_unloads", "Model unloads, by reason and mode.", "reason", "mode").inc(
        tags={"model": model, "reason": reason, "mode": mode})
    weights(model, 0)


def replicas(model: str, running: int, target: int) -> None:
    """The model's replicas running now and Serve's target for it (an autoscaled model's moves with load)."""
    gauge = _gauge("rayrunner_model_replicas", "Replicas of the model: running, and Serve's target.", "state")
    _held.set(gauge, float(running), {"model": model, "state": "running"})
    _held.set(gauge, float(target), {"model": model, "state": "target"})


def weights(model: str, weight_bytes: int) -> None:
    _held.set(_gauge("rayrunner_model_weight_bytes", "Bytes of weights the model's replica holds (0 when unloaded)."),
              float(weight_bytes), {"model": model})


# ------------------------------------------------------------ router


def request(model: str, route: str, status: int) -> None:
    """A finished request (a stream counts once, when it ends) with the HTTP status it got."""
    _counter("rayrunner_requests", "Requests, by route and HTTP status.", "route", "status").inc(
        tags={"model": model, "route": route, "status": str(status)})


# ------------------------------------------------------------ model replica


def generation(model: str, event: Any) -> None:
    """A finished choice's figures from its last `GenerationEvent`: time to first token (from arrival at the
    replica, queueing included), mean inter-token latency, and tokens in and out."""
    tags = {"model": model}
    _histogram("rayrunner_time_to_first_token_seconds", "From arrival at the model replica to the first token.",
               tuple(_LATENCY_S)).observe(event.prompt_time_s, tags=tags)
    if event.completion_tokens > 1:
        _histogram("rayrunner_inter_token_latency_seconds", "Mean seconds between a reply's tokens.",
                   tuple(_LATENCY_S)).observe(event.completion_time_s / (event.completion_tokens - 1), tags=tags)
    for name, description, count in (("rayrunner_prompt_tokens", "Prompt tokens.", event.prompt_tokens),
                                     ("rayrunner_cached_prompt_tokens", "Prompt tokens taken from the prefix cache.",
                                      getattr(event, "cached_tokens", 0)),
                                     ("rayrunner_completion_tokens", "Tokens generated.", event.completion_tokens)):
        if count > 0:  # Ray's counters refuse 0 (`echo` with max_tokens 0 generates none)
            _counter(name, description).inc(count, tags=tags)


def replica_sequences(model: str, replica: str, sequences: int) -> None:
    """The sequences one replica serves, running or waiting (what the request router balances), every second."""
    _held.set(_gauge("rayrunner_replica_sequences", "Sequences a model replica serves, running or waiting.", "replica"),
              float(sequences), {"model": model, "replica": replica})


def kv_cache(model: str, held: int, budget: int) -> None:
    """Bytes a model replica's KV caches hold (running sequences, prompts being prefilled, reused prefixes), and
    its budget."""
    tags = {"model": model}
    _held.set(_gauge("rayrunner_kv_cache_bytes", "Bytes the model replica's KV caches hold."), float(held), tags)
    _held.set(_gauge("rayrunner_kv_cache_budget_bytes", "The model replica's KV memory budget."), float(budget), tags)


def preempted(model: str) -> None:
    """A sequence's cache was dropped for KV memory; it is prefilled again later."""
    _counter("rayrunner_preemptions", "Sequences preempted for KV memory (recomputed later).").inc(
        1, tags={"model": model})


def sequences(model: str, running: int, queued: int) -> None:
    tags = {"model": model}
    _held.set(_gauge("rayrunner_running_sequences", "Sequences in the model's running batch."), running, tags)
    _held.set(_gauge("rayrunner_queued_requests", "Requests waiting for a slot in the batch."), queued, tags)
