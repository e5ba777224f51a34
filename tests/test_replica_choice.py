"""How the request router weighs replicas, without a cluster: a request's sequences, what `routing: prefix` keys on,
rendezvous hashing, and loads made of the last report plus what was sent since."""

from __future__ import annotations

import collections
import random

from rayrunner.router.replica_choice import (
    PREFIX_CHARS,
    ReplicaLoads,
    affinity_key,
    least_loaded_first,
    rendezvous,
    sequences_of,
)


def test_a_request_weighs_its_n_sequences() -> None:
    assert sequences_of({"n": 4}) == 4
    assert [sequences_of(body) for body in ({}, {"n": None}, {"n": 0}, None, "x")] == [1, 1, 1, 1, 1]


def test_the_affinity_key_is_the_user_else_the_prompts_start() -> None:
    chat = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]}
    assert affinity_key({**chat, "user": "alice"}) == "user:alice"
    assert affinity_key(chat) == affinity_key(dict(chat))
    long_a, long_b = "x" * PREFIX_CHARS + "a", "x" * PREFIX_CHARS + "b"
    assert affinity_key({"prompt": long_a}) == affinity_key({"prompt": long_b})  # only the start counts
    assert affinity_key({"prompt": "a"}) != affinity_key({"prompt": "b"})
    assert affinity_key({"input": "embed me"}) is None and affinity_key(None) is None


def test_rendezvous_spreads_keys_and_moves_only_a_lost_replicas() -> None:
    replicas = ["r1", "r2", "r3", "r4"]
    homes = {f"key {i}": rendezvous(f"key {i}", replicas) for i in range(2000)}
    spread = collections.Counter(homes.values())
    assert set(spread) == set(replicas) and min(spread.values()) > 400
    survivors = ["r1", "r2", "r4"]
    moved = [key for key, home in homes.items() if rendezvous(key, survivors) != home]
    assert moved and all(homes[key] == "r3" for key in moved)


def test_a_load_is_the_last_report_plus_open_sends_after_it_minus_what_it_counted_that_ended() -> None:
    loads = ReplicaLoads()
    loads.sent("a", "r1", 1, at=100.0)
    loads.sent("a", "r2", 4, at=101.5)
    loads.sent("a", "r3", 2, at=101.6)
    loads.completed("a", "r3", at=101.7)
    assert loads.load("a", {"sequences": 2, "at": 101.0}) == 6  # r1 is in the report, r2 is not, r3 ended
    loads.completed("a", "r1", at=102.2)
    assert loads.load("a", {"sequences": 2, "at": 101.0}) == 5  # the report counted r1, which has ended since
    assert loads.load("a", {"sequences": 4, "at": 102.5}) == 4  # the next report
    assert loads.load("b", {}) == 0  # never reported, nothing sent


def test_without_reports_a_load_is_what_this_router_sent() -> None:
    loads = ReplicaLoads()
    loads.sent("mute", "r1", 2, at=5.0)
    loads.sent("mute", "r2", 1, at=6.0)
    loads.completed("mute", "r1", at=7.0)
    assert loads.load("mute", {}) == 1
    loads.completed("mute", "r9", at=8.0)  # ended before Serve said it was sent: not counted when it does
    loads.sent("mute", "r9", 1, at=8.1)
    assert loads.load("mute", {}) == 1
    loads.forget(set())
    assert loads.load("mute", {}) == 0


def test_least_loaded_first_breaks_ties_at_random() -> None:
    random.seed(7)
    firsts = collections.Counter(least_loaded_first({"a": 1, "b": 1, "c": 5})[0] for _ in range(200))
    assert set(firsts) == {"a", "b"} and min(firsts.values()) > 60
    assert least_loaded_first({"a": 3, "b": 0, "c": 5}) == ["b", "a", "c"]
