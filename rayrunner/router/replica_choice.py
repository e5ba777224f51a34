"""Which replica of a model takes a request: Serve's request router, fed by the replicas' own load.

Serve's default router probes two random replicas for their ongoing requests. An LLM replica's load is its sequences
(a request with `n: 4` is four), running or waiting for a slot, so each replica reports them every second
(`ModelServer.record_routing_stats`), and `LoadAwareRouter` sends a request to the replica with the fewest: the
reported count plus the sequences this router sent it since that report and not yet finished. Serve still skips
a replica at its `max_ongoing_requests` and tries the next, so a full replica does not turn into a 429 while another
has room.

`routing: prefix` keeps requests that share a start (a chat's earlier turns, an agent's system prompt) or the
OpenAI `user` field on one replica (rendezvous hashing over the replicas, so adding one moves few keys), where its
engine can reuse that prefix, unless that replica is `imbalance` sequences busier than the least loaded one.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MEMORY_S = 10.0  # how long ended requests are remembered (reports come every second)
PREFIX_CHARS = 1024  # how much of a prompt's start keys `routing: prefix`
DEFAULT_IMBALANCE = 8


def sequences_of(body: Any) -> int:
    """The sequences a request body asks for (`n`; 1 for anything else)."""
    n = body.get("n") if isinstance(body, Mapping) else None
    return n if isinstance(n, int) and n > 0 else 1


def affinity_key(body: Any) -> str | None:
    """What `routing: prefix` keeps together: the OpenAI `user` (a session), else the prompt's first characters."""
    if not isinstance(body, Mapping):
        return None
    if isinstance(body.get("user"), str) and body["user"]:
        return "user:" + body["user"]
    prompt = body.get("messages", body.get("prompt"))
    if prompt is None:
        return None
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return "prefix:" + text[:PREFIX_CHARS]


def rendezvous(key: str, replica_ids: Sequence[str]) -> str:
    """The replica `key` belongs to: highest hash of (key, replica), so a key moves only when its replica goes."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest())


class ReplicaLoads:
    """Each replica's sequences as this router knows them: its last report, plus what it sent the replica after that
    report and is still open, minus what the report counted that has ended since (reports come every second)."""

    def __init__(self) -> None:
        self._open: dict[str, dict[str, tuple[float, int]]] = {}  # replica -> request id -> (sent at, sequences)
        self._ended: dict[str, list[tuple[float, float, int]]] = {}  # replica -> (sent at, ended at, sequences)
        self._ended_first: dict[str, float] = {}  # requests that ended before Serve said they were sent

    def sent(self, replica: str, request: str, sequences: int, at: float) -> None:
        if self._ended_first.pop(request, None) is None:
            self._open.setdefault(replica, {})[request] = (at, sequences)

    def completed(self, replica: str, request: str, at: float) -> None:
        """A request ended; a short one may end before Serve reports it sent (its completion is watched first)."""
        entry = self._open.get(replica, {}).pop(request, None)
        if entry is None:
            self._ended_first = {r: t for r, t in self._ended_first.items() if t >= at - MEMORY_S}
            self._ended_first[request] = at
            return
        ended = [e for e in self._ended.get(replica, []) if e[1] >= at - MEMORY_S]
        self._ended[replica] = [*ended, (entry[0], at, entry[1])]

    def load(self, replica: str, stats: Mapping[str, Any]) -> int:
        reported_at = float(stats.get("at", 0.0))
        sent_since = sum(n for at, n in self._open.get(replica, {}).values() if at >= reported_at)
        ended_since = sum(n for sent, ended, n in self._ended.get(replica, []) if sent < reported_at <= ended)
        return max(0, int(stats.get("sequences", 0)) + sent_since - ended_since)

    def forget(self, keep: set[str]) -> None:
        self._open = {replica: sent for replica, sent in self._open.items() if replica in keep}
        self._ended = {replica: ended for replica, ended in self._ended.items() if replica in keep}


def least_loaded_first(loads: Mapping[str, int]) -> list[str]:
    """Replica ids by load, ties in random order (so equal replicas share the requests)."""
    return sorted(loads, key=lambda rid: (loads[rid], random.random()))


class LoadAwareRouter(RequestRouter):
    """Serve request router of model deployments (see the module docstring). Not FIFO: each request takes the
    replica chosen for it (Serve's FIFOMixin hands a choice to the oldest waiting request, whose prefix may differ)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._loads = ReplicaLoads()
        self._routing = "least_loaded"
        self._imbalance = DEFAULT_IMBALANCE

    def initialize_state(self, **kwargs: Any) -> None:
        """`request_router_kwargs`: `routing` (`least_loaded` or `prefix`) and `imbalance` (sequences)."""
        self._routing = str(kwargs.get("routing", "least_loaded"))
        self._imbalance = int(kwargs.get("imbalance", DEFAULT_IMBALANCE))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Every candidate, each its own rank, best first: Serve takes the first that has room."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        loads = {rid: self._loads.load(rid, r.routing_stats or {}) for rid, r in by_id.items()}
        order = least_loaded_first(loads)
        body = pending_request.args[0] if pending_request is not None and pending_request.args else None
        key = affinity_key(body) if self._routing == "prefix" else None
        if key is not None and order:
            home = rendezvous(key, list(by_id))
            if loads[home] - loads[order[0]] <= self._imbalance:
                order.remove(home)
                order.insert(0, home)
        return [[by_id[rid]] for rid in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        body = pending_request.args[0] if pending_request.args else None
        self._loads.sent(replica_id.unique_id, pending_request.metadata.internal_request_id, sequences_of(body),
                         time.time())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._loads.completed(replica_id.unique_id, internal_request_id, time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._loads.forget({r.replica_id.unique_id for r in replicas})
