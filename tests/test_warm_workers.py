"""The spare-worker policy (pure: the raylet call is replaced by a recorder): `per_node` spares wait per node, a
spare a deploy took is replaced, and spares that did not fit are not piled on."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rayrunner.runtime import warm_workers
from rayrunner.runtime.warm_workers import WarmSpares


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    def record(worker: dict[str, Any], keep_alive_s: int, count: int = 1) -> bool:
        calls.extend([worker["node_id"]] * count)
        return True

    monkeypatch.setattr(warm_workers, "prestart_worker", record)
    return calls


def deployed(spares: WarmSpares, node: str, process_age_s: float, per_node: int = 1) -> None:
    now = time.time()
    worker = {"node_id": node, "job_id": "01000000", "runtime_env": "{}", "process_started_at": now - process_age_s}
    spares.after_deploy(worker, deployed_at=now, per_node=per_node)


def test_a_cold_deploy_asks_for_one_spare_and_a_warm_one_replaces_it(started: list[str]) -> None:
    spares = WarmSpares()
    deployed(spares, "n1", process_age_s=0)  # a fresh process: ask for a spare
    assert started == ["n1"]
    deployed(spares, "n1", process_age_s=30)  # it took the spare: ask for the next
    assert started == ["n1", "n1"]
    deployed(spares, "n2", process_age_s=0)  # another node gets its own
    assert started == ["n1", "n1", "n2"]


def test_a_spare_that_a_deploy_did_not_take_is_not_piled_on(started: list[str]) -> None:
    spares = WarmSpares()
    deployed(spares, "n1", process_age_s=0)
    deployed(spares, "n1", process_age_s=0)  # cold although a spare waits: it does not fit (e.g. a runtime_env)
    deployed(spares, "n1", process_age_s=0)
    assert started == ["n1"]


def test_with_two_per_node_a_cold_deploy_asks_for_two_and_each_taken_one_is_replaced(started: list[str]) -> None:
    spares = WarmSpares()
    deployed(spares, "n1", process_age_s=0, per_node=2)
    assert started == ["n1", "n1"]
    deployed(spares, "n1", process_age_s=30, per_node=2)  # it took one: one more
    deployed(spares, "n1", process_age_s=30, per_node=2)
    assert started == ["n1"] * 4
    deployed(spares, "n1", process_age_s=0, per_node=2)  # cold although two wait: none fits, none piled on
    assert started == ["n1"] * 4


def test_after_its_keep_alive_a_spare_is_asked_for_again(started: list[str]) -> None:
    spares = WarmSpares(keep_alive_s=0)
    deployed(spares, "n1", process_age_s=0)
    deployed(spares, "n1", process_age_s=0)
    assert started == ["n1", "n1"]


def test_a_failing_raylet_call_is_given_up_after_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def refuse(worker: dict[str, Any], keep_alive_s: int, count: int = 1) -> None:
        calls.append(worker["node_id"])
        raise RuntimeError("no such RPC")

    monkeypatch.setattr(warm_workers, "prestart_worker", refuse)
    spares = WarmSpares()
    deployed(spares, "n1", process_age_s=0)
    deployed(spares, "n1", process_age_s=30)
    assert calls == ["n1"] and spares.broken


@pytest.mark.parametrize("info", [{}, {"node_id": "n1"}, {"process_started_at": 1.0}, {"node_id": None,
                                                                                        "process_started_at": 1.0}])
def test_a_replica_that_says_nothing_of_its_process_asks_for_nothing(started: list[str], info: dict[str, Any]) -> None:
    WarmSpares().after_deploy(info, deployed_at=time.time())
    assert started == []


def test_a_node_gone_before_its_spare_is_asked_for_stops_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica's node died between its deploy and the call: nothing waits there, and later deploys (there or
    elsewhere) still get spares."""
    alive = {"n2"}
    calls: list[str] = []

    def prestart(worker: dict[str, Any], keep_alive_s: int, count: int = 1) -> bool:
        calls.append(worker["node_id"])
        return worker["node_id"] in alive

    monkeypatch.setattr(warm_workers, "prestart_worker", prestart)
    spares = WarmSpares()
    deployed(spares, "n1", process_age_s=0)
    assert not spares.broken and spares.waiting == {"n1": []}
    deployed(spares, "n2", process_age_s=0)
    assert calls == ["n1", "n2"] and len(spares.waiting["n2"]) == 1 and not spares.waiting["n1"]


def test_a_model_a_config_deployed_gets_a_spare_unless_one_waits(started: list[str]) -> None:
    spares = WarmSpares()
    worker = {"node_id": "n1", "job_id": "01000000", "runtime_env": "{}", "process_started_at": time.time() - 60}
    spares.after_adopt(worker)  # `serve run` deployed the model: the first stop must not start cold
    spares.after_adopt({**worker, "node_id": "n2"})
    spares.after_adopt(worker)  # a second model of the config on n1: the spare asked for already waits
    assert started == ["n1", "n2"]


@pytest.mark.slow  # a fresh interpreter imports the whole model stack
def test_a_replica_worker_preloads_the_model_server() -> None:
    """The import a model replica's worker runs as it starts (rayrunner.runtime.preload with RAYRUNNER_PRELOAD=1)
    gets through to the model server: rayrunner's __init__ imports warm_workers, which once imported worker_preload
    back, so the model server's import of warm_workers failed half-way and the spares waited without it. What it
    imported is frozen out of later garbage collections (Serve's full collection at a replica's start walked it),
    and transformers' conversion mapping, built at a process's first load, is built already."""
    code = ("import gc, sys, rayrunner.runtime.preload; "
            "assert 'rayrunner.replica.model_server' in sys.modules, 'model server not preloaded'; "
            "assert gc.get_freeze_count() > 100_000, gc.get_freeze_count(); "
            "import transformers.conversion_mapping as c; assert c._checkpoint_conversion_mapping_cache")
    env = {**os.environ, warm_workers.PRELOAD_ENV_VAR: "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "could not preload" not in done.stderr, done.stderr[-2000:]


def test_the_preload_imports_at_low_priority_and_gives_it_back() -> None:
    """While a spare imports it yields the CPU to serving replicas; once done, it and every thread started meanwhile
    (an import may start native threads) are back at its own priority (a replica must never run slower than its
    peers). Where the process could not raise it back, nothing changes."""
    from rayrunner.runtime.preload import _may_set_niceness, lower_priority

    def niceness(thread_id: int) -> int:
        return int(Path(f"/proc/self/task/{thread_id}/stat").read_text().rsplit(")", 1)[1].split()[16])

    before = os.getpriority(os.PRIO_PROCESS, 0)
    release = threading.Event()
    started_inside = threading.Thread(target=release.wait)
    with lower_priority(10):
        during = os.getpriority(os.PRIO_PROCESS, 0)
        started_inside.start()
    try:
        assert os.getpriority(os.PRIO_PROCESS, 0) == before
        assert started_inside.native_id is not None and niceness(started_inside.native_id) == before
    finally:
        release.set()
        started_inside.join()
    assert during == (min(before + 10, 19) if _may_set_niceness(before) else before)


def test_the_router_and_model_replicas_serve_at_normal_priority_however_ray_started() -> None:
    """A plain `serve run` starts Ray's workers at nice 15: the router's and the model replicas' setup hooks bring
    them back to 0 (where the process may), the router's without importing the model stack."""
    from rayrunner.router.app import Router
    from rayrunner.runtime import ray_private

    options = Router.ray_actor_options or {}
    hook = options["runtime_env"]["env_vars"][ray_private.SETUP_HOOK_ENV_VAR]
    assert hook == "rayrunner.runtime.preload.serving_setup"
    replica_hook = warm_workers.REPLICA_RUNTIME_ENV["env_vars"][ray_private.SETUP_HOOK_ENV_VAR]
    assert replica_hook == "rayrunner.runtime.preload.worker_setup"
    code = ("import os, sys, rayrunner.runtime.preload as p; p.serving_setup(); "
            "print(os.getpriority(os.PRIO_PROCESS, 0), 'torch' in sys.modules)")
    done = subprocess.run(["nice", "-n", "15", sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    from rayrunner.runtime.preload import _may_set_niceness

    niceness, imported = done.stdout.split()
    assert int(niceness) == (0 if _may_set_niceness(0) else 15) and imported == "False"
