"""A request storm over real HTTP: clients send chat, streamed chat, completions and embeddings while a driver
unloads, reloads, switches the default, adds and removes models every few seconds.

Every outcome is checked against the documented statuses (200, or 400 / 404 model_not_found / 409 / 429
server_overloaded / 503 model_unavailable or capacity_exhausted with an OpenAI-shaped body); a stream must end with
`data: [DONE]`, an error event (documented code) allowed only just before it. Anything else (a 5xx, a timeout, a cut
stream, a malformed body) is a problem. After the storm, `settle` waits for loads under way and reports a model left
`reloading` or a registry status that Serve's replica counts contradict.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.conftest import model_entry

STATE_CODES = {"model_already_unloaded", "model_already_loaded", "model_reloading", "model_removing", "model_exists",
               "alias_conflict"}
DOCUMENTED: dict[int, set[str] | None] = {
    400: None,  # any code: invalid_request, invalid_model_spec, unsupported_request, ...
    404: {"model_not_found"},
    409: STATE_CODES,
    429: {"server_overloaded"},
    503: {"model_unavailable", "capacity_exhausted"},
}
# Codes a stream may carry in-band (its headers were sent already): the model went away under it.
STREAM_ERROR_CODES = {"model_unavailable", "model_not_found", "capacity_exhausted", "server_overloaded"}
ERROR_KEYS = {"message", "type", "param", "code"}
KINDS = ("chat", "chat_stream", "completion", "embedding")
OPS_IN_FLIGHT = 3
OPERATIONS = ("unload", "add", "reload", "default", "remove", "unload", "reload", "default")  # each kind in 5


@dataclass(frozen=True)
class Models:
    """What the storm aims at: text models the driver unloads, reloads and makes default (and names for them),
    an embedding model it unloads and reloads, and a model id it adds and removes."""

    text: tuple[str, ...]
    text_names: tuple[str, ...]  # ids, aliases and `default`: what text requests ask for
    embedding: str
    transient: str
    transient_which: dict[str, Any]


def storm_config(tiny_llama_dir: str, state_path: str) -> tuple[dict[str, Any], Models]:
    """The storm's router config (two tiny text models and `all-minilm-l6-v2`) and its targets."""
    embedding = {"spec": {"model_id": "all-minilm-l6-v2", "which": {"type": "embedding",
                                                                    "model_id": "all-minilm-l6-v2"}},
                 "aliases": ["minilm"], "load": True}
    config = {
        "models": [model_entry("storm-a", tiny_llama_dir, aliases=["sa"], max_seq_len=256),
                   model_entry("org/storm-b", tiny_llama_dir, aliases=["sb"], max_seq_len=256), embedding],
        "default_model": "storm-a",
        "state_path": state_path,
    }
    models = Models(text=("storm-a", "org/storm-b"), text_names=("storm-a", "sa", "org/storm-b", "sb", "default"),
                    embedding="all-minilm-l6-v2", transient="storm-c",
                    transient_which={"type": "plain", "model_id": tiny_llama_dir})
    return config, models


@dataclass
class Tally:
    """Outcomes by `kind status[ code]`, lifecycle operations the same way, and every problem seen."""

    requests: Counter[str] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, counter: Counter[str], label: str, problem: str | None) -> None:
        with self.lock:
            counter[label] += 1
            if problem:
                self.problems.append(f"{label}: {problem}")


def error_problem(status: int, body: Any) -> tuple[str, str | None]:
    """(code, problem): the error's code, and what is wrong with a non-200 answer (None when it is documented)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS:
        return "?", f"not an OpenAI error body: {str(body)[:200]}"
    code = str(error["code"])
    allowed = DOCUMENTED.get(status, set())
    if allowed is not None and code not in allowed:
        return code, f"undocumented: {str(body)[:300]}"
    return code, None


def stream_problem(events: list[str]) -> tuple[str, str | None]:
    """(in-band error code or "", problem) for a 200 stream's `data:` payloads."""
    if not events or events[-1] != "[DONE]":
        return "", f"stream cut without [DONE] after {len(events)} events: {events[-2:]}"
    errors = [i for i, event in enumerate(events[:-1]) if '"error"' in event and "error" in json.loads(event)]
    if not errors:
        return "", None
    error = json.loads(events[errors[0]])["error"]
    code = str(error.get("code"))
    if errors != [len(events) - 2]:
        return code, "error event not last before [DONE]"
    if set(error) != ERROR_KEYS or code not in STREAM_ERROR_CODES:
        return code, f"undocumented stream error: {error}"
    return code, None


class Storm:
    """`clients` threads of mixed requests plus one lifecycle driver, for `duration_s` seconds (longer, up to 3x,
    when the driver has not been through every operation by then: loads are slow on a busy machine)."""

    def __init__(self, url: str, models: Models, clients: int, duration_s: float, op_interval_s: float = 2.0,
                 seed: int = 0, request_timeout_s: float = 120.0) -> None:
        self.url, self.models, self.clients = url, models, clients
        self.duration_s, self.op_interval_s, self.seed = duration_s, op_interval_s, seed
        self.timeout = request_timeout_s
        self.tally = Tally()
        self._stop = threading.Event()
        self._steps = 0  # lifecycle operations done
        self.elapsed_s = 0.0

    def run(self) -> Tally:
        threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(self.clients)]
        threads.append(threading.Thread(target=self._driver, daemon=True))
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(self.duration_s)
        # and on, up to three times as long, until the driver has done every kind of operation once
        while self._steps < len(set(OPERATIONS)) and time.monotonic() - started < 3 * self.duration_s:
            time.sleep(0.5)
        self._stop.set()
        for thread in threads:
            thread.join(self.timeout + 120)  # a request's time, and the driver's last operations' (a remove retries)
            if thread.is_alive():
                self.tally.problems.append(f"{thread.name} still running {self.timeout + 120:.0f} s after the end")
        self.elapsed_s = time.monotonic() - started
        return self.tally

    # ------------------------------------------------------------ clients

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
            while not self._stop.is_set():
                kind = rng.choice(KINDS)
                try:
                    label, problem = self._send(http, kind, rng)
                except httpx.HTTPError as exc:  # a hang (timeout), a reset, a stream cut mid-chunk
                    label, problem = f"{kind} {type(exc).__name__}", repr(exc)
                self.tally.record(self.tally.requests, label, problem)

    def _send(self, http: httpx.Client, kind: str, rng: random.Random) -> tuple[str, str | None]:
        text_model = rng.choice((*self.models.text_names, self.models.transient))
        max_tokens = rng.randint(1, 12)
        messages = [{"role": "user", "content": f"storm {rng.random():.6f}"}]
        if kind == "embedding":
            return self._unary(http, kind, "/v1/embeddings", {"model": self.models.embedding,
                                                               "input": ["storm", f"{rng.random()}"]})
        if kind == "completion":
            body = {"model": text_model, "prompt": f"storm {rng.random()}", "max_tokens": max_tokens}
            return self._unary(http, kind, "/v1/completions", body)
        body = {"model": text_model, "messages": messages, "max_tokens": max_tokens}
        if kind == "chat":
            return self._unary(http, kind, "/v1/chat/completions", body)
        return self._stream(http, kind, {**body, "stream": True})

    def _unary(self, http: httpx.Client, kind: str, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
        response = http.post(path, json=body)
        return _classify(kind, response.status_code, response.text, "data" if kind == "embedding" else "choices")

    def _stream(self, http: httpx.Client, kind: str, body: dict[str, Any]) -> tuple[str, str | None]:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return _classify(kind, response.status_code, response.read().decode(), "")
            events = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        code, problem = stream_problem(events)
        return (f"{kind} 200 +error {code}" if code else f"{kind} 200"), problem

    # ------------------------------------------------------------ lifecycle driver

    def _driver(self) -> None:
        """An operation every `op_interval_s`, each in its own thread (a load can take longer than the interval),
        so up to OPS_IN_FLIGHT of them race each other as well as the clients."""
        rng = random.Random(self.seed)
        running: list[threading.Thread] = []
        while not self._stop.wait(self.op_interval_s):
            running = [op for op in running if op.is_alive()]
            if len(running) >= OPS_IN_FLIGHT:
                continue
            operation = OPERATIONS[self._steps % len(OPERATIONS)]
            self._steps += 1
            op = threading.Thread(target=self._operation, args=(operation, random.Random(rng.random())), daemon=True)
            op.start()
            running.append(op)
        for op in running:
            op.join(self.timeout + 60)

    def _operation(self, operation: str, rng: random.Random) -> None:
        with httpx.Client(base_url=self.url, timeout=self.timeout) as http:
            try:
                response = self._operate(http, operation, rng)
            except httpx.HTTPError as exc:
                self.tally.record(self.tally.operations, f"{operation} {type(exc).__name__}", repr(exc))
                return
        label, problem = _classify(operation, response.status_code, response.text, "")
        self.tally.record(self.tally.operations, label, problem)

    def _operate(self, http: httpx.Client, operation: str, rng: random.Random) -> httpx.Response:
        models = self.models
        if operation == "add":
            body = {"model_id": models.transient, "which": models.transient_which, "load": rng.random() < 0.5}
            return http.post("/v1/models/add", json=body)
        if operation == "remove":
            return self._remove(http)
        if operation == "default":
            return http.post("/v1/models/default", json={"model_id": rng.choice((*models.text, models.transient))})
        # aim mostly at a model in the other state, so the operation races the clients' own reloads
        wanted = "loaded" if operation == "unload" else "unloaded"
        cards = http.get("/v1/models").json()["data"]
        targets = [c["id"] for c in cards if c["status"] == wanted]
        if not targets or rng.random() < 0.2:
            targets = [*models.text, models.embedding, models.transient]
        return http.post(f"/v1/models/{operation}", json={"model_id": rng.choice(targets)})

    def _remove(self, http: httpx.Client) -> httpx.Response:
        """Remove the transient model, retrying (as an admin would) while clients' requests keep reloading it."""
        deadline = time.monotonic() + max(60.0, 10 * self.op_interval_s)  # a load takes 20 s+ on a busy box
        while True:
            response = http.post("/v1/models/remove", json={"model_id": self.models.transient})
            reloading = response.status_code == 409 and response.json()["error"]["code"] == "model_reloading"
            if not reloading or time.monotonic() > deadline:
                return response
            self.tally.record(self.tally.operations, "remove 409 model_reloading", None)
            time.sleep(0.5)


def _classify(kind: str, status: int, text: str, ok_key: str) -> tuple[str, str | None]:
    try:
        body = json.loads(text)
    except ValueError:
        return f"{kind} {status}", f"body is not JSON: {text[:200]}"
    if status in (200, 201):
        if ok_key and (not isinstance(body, dict) or not body.get(ok_key)):
            return f"{kind} {status}", f"no `{ok_key}` in {text[:200]}"
        return f"{kind} {status}", None
    code, problem = error_problem(status, body)
    return f"{kind} {status} {code}", problem


# ------------------------------------------------------------ after the storm


def settle(http: httpx.Client, check_serve: bool, timeout_s: float = 180.0) -> list[str]:
    """Problems left once loads under way had `timeout_s` to finish: a model still `reloading`, or (with
    `check_serve`, in a process connected to the cluster) a registry status Serve's replica counts contradict."""
    deadline = time.monotonic() + timeout_s
    while True:
        problems = _disagreements(http, check_serve)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.5)


def _disagreements(http: httpx.Client, check_serve: bool) -> list[str]:
    cards = http.get("/v1/models").json()["data"]
    problems = [f"`{c['id']}` is still reloading" for c in cards if c["status"] == "reloading"]
    if not check_serve or problems:
        return problems
    from rayrunner.models.spec import model_app_name
    from rayrunner.registry.model_apps import app_state

    for card in cards:
        state = app_state(model_app_name(card["id"]))
        if card["status"] == "loaded" and not (state.running >= 1 and state.total == state.running):
            problems.append(f"`{card['id']}` is loaded, Serve has {state.running}/{state.total} running")
        if card["status"] == "unloaded" and card["unload_mode"] != "sleep" and state.total != 0:
            problems.append(f"`{card['id']}` is unloaded, Serve has {state.total} replicas")
    return problems


def summary(tally: Tally, duration_s: float) -> str:
    """A plain-text table of requests and operations by outcome, with totals and the duration."""
    lines = [f"{'requests by outcome':<48}{'count':>8}"]
    lines += [f"  {label:<46}{count:>8}" for label, count in sorted(tally.requests.items())]
    lines.append(f"  {'total':<46}{sum(tally.requests.values()):>8}")
    lines.append(f"{'lifecycle operations by outcome':<48}{'count':>8}")
    lines += [f"  {label:<46}{count:>8}" for label, count in sorted(tally.operations.items())]
    lines.append(f"  {'total':<46}{sum(tally.operations.values()):>8}")
    lines.append(f"{'duration (s)':<48}{duration_s:>8.1f}")
    lines.append(f"{'problems':<48}{len(tally.problems):>8}")
    lines += [f"  {problem}" for problem in tally.problems[:20]]
    return "\n".join(lines)
