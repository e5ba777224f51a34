"""Which replica of a model takes a request: Serve's request router, fed by the replicas' own load.

Serve's default router probes two random replicas for their ongoing requests. An LLM replica's load is its sequences
(a request with `n: 4` is four), running or waiting for a slot, so each replica reports the requests it serves with
their sequences every second (`ModelServer.record_routing_stats`), and `LoadAwareRouter` sends a request to the
replica with the fewest: what the last report lists (less what this router has seen end since), plus what this router
chose for that replica that the report does not list yet (in transit, or sent after it). Requests are matched by
Serve's request id, never by clock, so a report taken while a request was on its way still counts it once. Serve
still skips a replica at its `max_ongoing_requests` and tries the next, so a full replica does not turn into a 429
while another has room.

`routing: prefix` keeps requests of one chat (its system prompt and first user turn, which every later turn repeats)
or of one OpenAI `user` on one replica (rendezvous hashing over the replicas, so adding one moves few keys), where
its engine can reuse that prefix, unless that replica is `imbalance` sequences busier than the least loaded one.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

MEMORY_S = 10.0  # how long ended requests are remembered (reports come every second)
PREFIX_CHARS = 1024  # how much of a completion prompt's start keys `routing: prefix`
DEFAULT_IMBALANCE = 8


def sequences_of(body: Any) -> int:
    """The sequences a request body asks for (`n`; 1 for anything else)."""
    n = body.get("n") if isinstance(body, Mapping) else None
    return n if isinstance(n, int) and n > 0 else 1


def affinity_key(body: Any) -> str | None:
    """What `routing: prefix` keeps together: the OpenAI `user` (a session), else a chat's opening (every turn of a
    chat repeats it), else a completion prompt's first characters."""
    if not isinstance(body, Mapping):
        return None
    if isinstance(body.get("user"), str) and body["user"]:
        return "user:" + body["user"]
    if isinstance(body.get("messages"), list):
        return "chat:" + json.dumps(chat_opening(body["messages"]), sort_keys=True, default=str)
    prompt = body.get("prompt")
    if prompt is None:
        return None
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return "prefix:" + text[:PREFIX_CHARS]


def chat_opening(messages: list[Any]) -> list[Any]:
    """The messages up to and including the first user turn (the system prompt and the question that starts the
    chat); all of them when no user turn is there."""
    for index, message in enumerate(messages):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return messages[:index + 1]
    return messages


def rendezvous(key: str, replica_ids: Sequence[str]) -> str:
    """The replica `key` belongs to: highest hash of (key, replica), so a key moves only when its replica goes."""
    return max(replica_ids, key=lambda rid: hashlib.blake2b(f"{key}\0{rid}".encode(), digest_size=8).digest())


class _Open(NamedTuple):
    replica: str
    sequences: int
    chosen_at: float | None  # when the router chose the replica; None once Serve said the replica took it


class ReplicaLoads:
    """Each replica's sequences as this router knows them: what its last report lists (request id -> sequences),
    less what this router has seen end there, plus what this router chose for it that the report does not list.

    Keyed by Serve's internal request id, which a request made while serving another inherits: the router's retry
    of a request whose replica died comes again under the same id, so an end is remembered per replica and a new
    choice starts the request afresh."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}  # request id -> where it went
        self._ended: dict[tuple[str, str], float] = {}  # (replica, request id) -> when it ended, in that order

    def chosen(self, replica: str, request: str, sequences: int, at: float) -> None:
        """The router ranked `replica` first for a request: it counts there from now (Serve sends it there unless
        that replica is full; `routed` then names the one that took it)."""
        self._forget_old(at)
        self._ended.pop((replica, request), None)
        self._open[request] = _Open(replica, sequences, at)

    def routed(self, replica: str, request: str) -> None:
        """Serve sent the request to `replica`, which took it (unless it has ended already: Serve may say it ended
        before it says it was routed)."""
        entry = self._open.get(request)
        if entry is not None:
            self._ended.pop((replica, request), None)
            self._open[request] = _Open(replica, entry.sequences, None)

    def completed(self, replica: str, request: str, at: float) -> None:
        self._forget_old(at)
        self._open.pop(request, None)
        self._ended.pop((replica, request), None)  # re-inserted last: the memory stays in the order of the ends
        self._ended[(replica, request)] = at

    def load(self, replica: str, stats: Mapping[str, Any]) -> int:
        """The replica's sequences: its report's requests not seen ending, and this router's it does not list."""
        reported = stats.get("requests")
        listed: Mapping[str, int] = reported if isinstance(reported, Mapping) else {}
        serving = sum(n for request, n in listed.items() if (replica, request) not in self._ended)
        in_transit = sum(entry.sequences for request, entry in self._open.items()
                         if entry.replica == replica and request not in listed)
        return serving + in_transit

    def forget(self, keep: set[str]) -> None:
        """Drop what was sent to replicas that are gone."""
        self._open = {request: entry for request, entry in self._open.items() if entry.replica in keep}

    def _forget_old(self, now: float) -> None:
        """Ends older than MEMORY_S (no report lists them any more), and choices Serve never routed (a request
        cancelled while it waited for a replica)."""
        while self._ended and next(iter(self._ended.values())) < now - MEMORY_S:
            del self._ended[next(iter(self._ended))]
        self._open = {request: entry for request, entry in self._open.items()
                      if entry.chosen_at is None or entry.chosen_at >= now - MEMORY_S}


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
        """Every candidate, each its own rank, best first: Serve takes the first that has room. The first counts
        the request at once, so a burst chosen before any of it is sent spreads by load."""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = self.rank(by_id, pending_request)
        if order and pending_request is not None:
            self._loads.chosen(order[0], pending_request.metadata.internal_request_id,
                               sequences_of(_body(pending_request)), time.time())
        return [[by_id[rid]] for rid in order]

    def rank(self, by_id: Mapping[str, RunningReplica], pending_request: PendingRequest | None) -> list[str]:
        """Replica ids best first: least loaded, or a prefix's home replica unless it is much busier."""
        loads = {rid: self._loads.load(rid, r.routing_stats or {}) for rid, r in by_id.items()}
        order = least_loaded_first(loads)
        key = affinity_key(_body(pending_request)) if self._routing == "prefix" else None
        if key is not None and order:
            home = rendezvous(key, list(by_id))
            if loads[home] - loads[order[0]] <= self._imbalance:
                order.remove(home)
                order.insert(0, home)
        return order

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._loads.routed(replica_id.unique_id, pending_request.metadata.internal_request_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._loads.completed(replica_id.unique_id, internal_request_id, time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._loads.forget({r.replica_id.unique_id for r in replicas})


def _body(pending_request: PendingRequest | None) -> Any:
    """A request's body: its first argument (None for a call without one)."""
    return pending_request.args[0] if pending_request is not None and pending_request.args else None
