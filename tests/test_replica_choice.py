"""How the request router weighs replicas, without a cluster: a request's sequences, what `routing: prefix` keys on,
rendezvous hashing, and loads made of the last report plus what this router chose that the report does not list,
in every order the router's and the replica's events can come in."""

from __future__ import annotations

import collections
import itertools
import random
from types import SimpleNamespace
from typing import Any

from ray.serve._private.common import DeploymentHandleSource, DeploymentID

from rayrunner.router.replica_choice import (
    MEMORY_S,
    PREFIX_CHARS,
    LoadAwareRouter,
    ReplicaLoads,
    affinity_key,
    least_loaded_first,
    rendezvous,
    sequences_of,
)


def test_a_request_weighs_its_n_sequences() -> None:
    assert sequences_of({"n": 4}) == 4
    assert [sequences_of(body) for body in ({}, {"n": None}, {"n": 0}, None, "x")] == [1, 1, 1, 1, 1]


def test_the_affinity_key_is_the_user_else_the_chats_opening_else_the_prompts_start() -> None:
    chat = {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}]}
    assert affinity_key({**chat, "user": "alice"}) == "user:alice"
    assert affinity_key(chat) == affinity_key(dict(chat))
    long_a, long_b = "x" * PREFIX_CHARS + "a", "x" * PREFIX_CHARS + "b"
    assert affinity_key({"prompt": long_a}) == affinity_key({"prompt": long_b})  # only the start counts
    assert affinity_key({"prompt": "a"}) != affinity_key({"prompt": "b"})
    assert affinity_key({"input": "embed me"}) is None and affinity_key(None) is None


def turns(first: str, count: int, system: str = "You are terse.") -> list[dict[str, Any]]:
    """The request bodies of a chat's first `count` turns: each repeats the turns before it and their answers."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    bodies = [{"messages": list(messages)}]
    for turn in range(2, count + 1):
        messages += [{"role": "assistant", "content": f"answer {turn - 1}"},
                     {"role": "user", "content": f"and then {turn}?"}]
        bodies.append({"messages": list(messages)})
    return bodies


def test_every_turn_of_a_short_chat_keys_alike_and_other_chats_apart() -> None:
    chat = turns("What is the capital of France?", 3)
    assert len({affinity_key(body) for body in chat}) == 1
    other = turns("What is the capital of Spain?", 3)
    assert len({affinity_key(body) for body in other}) == 1 and affinity_key(other[0]) != affinity_key(chat[0])
    long_system = "x" * 4 * PREFIX_CHARS  # a long shared system prompt: the first question still tells chats apart
    assert affinity_key(turns("a", 1, long_system)[0]) != affinity_key(turns("b", 1, long_system)[0])
    assert affinity_key(turns("a", 1)[0]) != affinity_key(turns("a", 1, "You are verbose.")[0])
    only_system = {"messages": [{"role": "system", "content": "only"}]}
    assert affinity_key(only_system) == affinity_key({**only_system})


def test_rendezvous_spreads_keys_and_moves_only_a_lost_replicas() -> None:
    replicas = ["r1", "r2", "r3", "r4"]
    homes = {f"key {i}": rendezvous(f"key {i}", replicas) for i in range(2000)}
    spread = collections.Counter(homes.values())
    assert set(spread) == set(replicas) and min(spread.values()) > 400
    survivors = ["r1", "r2", "r4"]
    moved = [key for key, home in homes.items() if rendezvous(key, survivors) != home]
    assert moved and all(homes[key] == "r3" for key in moved)


def test_a_load_is_the_report_less_what_ended_plus_what_it_does_not_list_yet() -> None:
    loads = ReplicaLoads()
    loads.chosen("a", "r1", 1, at=100.0)
    loads.chosen("a", "r2", 4, at=100.1)
    loads.chosen("a", "r3", 2, at=100.2)
    loads.completed("a", "r3", at=100.3)
    assert loads.load("a", {"requests": {"r1": 1, "r3": 2}}) == 5  # r1 listed, r2 on its way, r3 ended
    assert loads.load("a", {"requests": {"r1": 1, "r2": 4, "another router's": 3}}) == 8
    assert loads.load("b", {}) == 0  # never reported, nothing sent
    loads.completed("a", "r1", at=100.4)
    loads.completed("a", "r2", at=100.5)
    assert loads.load("a", {"requests": {"r1": 1, "r2": 4}}) == 0  # a report from before they ended
    assert loads.load("a", {}) == 0


EVENTS = ("chosen", "received", "routed", "finished", "completed", "report")
BEFORE = [("chosen", "received"), ("received", "routed"), ("received", "finished"), ("finished", "completed")]


def interleavings() -> list[tuple[str, ...]]:
    """Every order one request's events can come in: the router chooses the replica, the replica receives it,
    Serve says the replica took it (`routed`, possibly after the end), the replica finishes it, the router sees it
    end; and the replica takes its report at any point among them."""
    return [order for order in itertools.permutations(EVENTS)
            if all(order.index(first) < order.index(then) for first, then in BEFORE)]


def test_every_interleaving_of_a_request_and_a_report_counts_it_once_until_it_ends() -> None:
    """Whether the report has reached the router or not, at every step the load is the request's four sequences
    from the choice until the router sees the end, and nothing after it."""
    assert len(interleavings()) == 18
    for order in interleavings():
        loads, serving, report, counted = ReplicaLoads(), dict[str, int](), None, False
        for step, event in enumerate(order):
            if event == "chosen":
                loads.chosen("a", "r", 4, at=float(step))
                counted = True
            elif event == "received":
                serving = {"r": 4}
            elif event == "routed":
                loads.routed("a", "r")
            elif event == "finished":
                serving = {}
            elif event == "completed":
                loads.completed("a", "r", at=float(step))
                counted = False
            else:
                report = {"requests": dict(serving)}
            for seen in ({}, report) if report is not None else ({},):
                assert loads.load("a", seen) == (4 if counted else 0), (order, event, seen)


def test_a_retry_under_the_same_id_counts_on_its_new_replica() -> None:
    """A call made while serving another takes the parent's id: the retry after a replica died comes again."""
    loads = ReplicaLoads()
    loads.chosen("a", "r", 1, at=1.0)
    loads.completed("a", "r", at=2.0)
    loads.chosen("b", "r", 1, at=2.1)
    assert loads.load("b", {}) == 1 and loads.load("b", {"requests": {"r": 1}}) == 1
    assert loads.load("a", {"requests": {"r": 1}}) == 0
    loads.routed("b", "r")
    loads.completed("b", "r", at=3.0)
    loads.routed("b", "r")  # told after the end: not counted again
    assert loads.load("b", {}) == 0


def test_serve_taking_the_second_choice_moves_the_request_there() -> None:
    loads = ReplicaLoads()
    loads.chosen("full", "r", 2, at=1.0)
    loads.routed("spare", "r")
    assert (loads.load("full", {}), loads.load("spare", {})) == (0, 2)


def test_choices_never_routed_and_replicas_gone_are_forgotten() -> None:
    loads = ReplicaLoads()
    loads.chosen("a", "cancelled", 2, at=1.0)  # cancelled while it waited for a replica: Serve says no more
    loads.chosen("a", "r", 1, at=1.0)
    loads.routed("a", "r")
    loads.chosen("b", "s", 1, at=1.0 + MEMORY_S + 1)
    assert loads.load("a", {}) == 1
    loads.forget({"b"})
    assert (loads.load("a", {}), loads.load("b", {})) == (0, 1)


def replica(unique_id: str) -> Any:
    """What the router reads of a running replica: its id and its routing stats (none reported yet)."""
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=unique_id), routing_stats=None)


def pending(request_id: str, body: dict[str, Any]) -> Any:
    return SimpleNamespace(args=[body], metadata=SimpleNamespace(internal_request_id=request_id))


async def test_a_burst_chosen_before_anything_is_sent_spreads_by_sequences() -> None:
    """The router's choices come one after another before Serve sends any of them, and before any report: one
    request of four sequences, then singles, which go to the other replica until it holds as many."""
    router = LoadAwareRouter(DeploymentID(name="ModelServer", app_name="m"), DeploymentHandleSource.UNKNOWN)
    router.initialize_state()
    replicas = [replica("a"), replica("b")]

    async def first_choice(request_id: str, body: dict[str, Any]) -> str:
        ranks = await router.choose_replicas(replicas, pending(request_id, body))
        return str(ranks[0][0].replica_id.unique_id)

    heavy = await first_choice("r0", {"n": 4})
    light = "b" if heavy == "a" else "a"
    assert [await first_choice(f"r{i}", {}) for i in range(1, 4)] == [light] * 3
    burst = collections.Counter([await first_choice(f"s{i}", {}) for i in range(8)])
    assert abs((4 + burst[heavy]) - (3 + burst[light])) <= 1, burst


def test_least_loaded_first_breaks_ties_at_random() -> None:
    random.seed(7)
    firsts = collections.Counter(least_loaded_first({"a": 1, "b": 1, "c": 5})[0] for _ in range(200))
    assert set(firsts) == {"a", "b"} and min(firsts.values()) > 60
    assert least_loaded_first({"a": 3, "b": 0, "c": 5}) == ["b", "a", "c"]
