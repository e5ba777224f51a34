"""Warm spare workers: a model stopped and loaded again starts in a process that has already imported its stack.

Measured on a 2-core CPU box (`bench/bench_lifecycle.py`): a replica's weights load in 0.3-0.7 s, but a reload
after a `stop` took 6-7 s, of which ~5 s went to the new worker process: Python and Ray start, then torch,
transformers and rayrunner's model server import. Ray gives a new actor an idle worker of the same job and runtime
env when the node has one, so:

- model replicas run with `REPLICA_RUNTIME_ENV` (`RAYRUNNER_PRELOAD=1` and a worker setup hook), so a worker started
  for one imports the model stack and takes the node's normal priority as it starts, however the cluster was started
  (a cluster started by rayrunner's scripts also sets `CLUSTER_ENV`, which does the same through Ray's preload);
- `SPARE_DELAY_S` after each deploy of a model (the registry's own, or a config's it adopted), the registry asks
  that node's raylet for spare workers with the replica's own job and runtime env (the router's `warm_spares`
  per node, default 1; 0: none), each kept alive `KEEP_ALIVE_S`
  (`WarmSpares`). It starts, imports, and waits; the next replica started on the node takes it.

Ray 2.60 has no public Python API for the raylet's PrestartWorkers call, so it goes through Ray's generated gRPC
stub; if that fails, a warning is logged once and loads start cold, as before. At most `warm_spares` per node wait: a
deploy that ran in a fresh process while a spare was waiting means the spare did not fit, and no other is asked for
on that node until the waiting one's keep-alive ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rayrunner.runtime import ray_private
from rayrunner.runtime import transport as serve_transport

logger = logging.getLogger(__name__)

# Not imported from rayrunner.runtime.preload, which imports the model server when this is set: rayrunner's
# __init__ imports this module, so the model server's own import of it would find it half-initialized.
PRELOAD_ENV_VAR = "RAYRUNNER_PRELOAD"
# Read by the raylet when it starts (and by the processes it starts): spares import the model stack; Serve's hops
# go over gRPC (`serve_transport`); workers run at the node's normal priority. Ray starts its workers (every
# replica, the router, the proxy) at nice 15, so any busy nice-0 process on the node (a load generator, a monitoring
# agent) takes the cores from the serving path: on a 2-core box a decoding replica then spun at 72% CPU for ~1
# token/s. Serving is what a rayrunner node is for; a spare still imports at a lower priority (`worker_preload`).
CLUSTER_ENV = {"RAY_preload_python_modules": "rayrunner.runtime.preload", "RAY_worker_niceness": "0",
               **serve_transport.CLUSTER_ENV}
# Model replicas, and the spares started for them, import the stack as they start however the cluster was started
# (a plain `serve run` sets none of `CLUSTER_ENV`): Ray runs `worker_setup` in each before its first task.
REPLICA_RUNTIME_ENV = {"env_vars": {PRELOAD_ENV_VAR: "1", **serve_transport.REPLICA_ENV,
                                    ray_private.SETUP_HOOK_ENV_VAR: "rayrunner.runtime.preload.worker_setup"}}
# The router imports no model stack, but serves at the node's normal priority however the cluster was started.
ROUTER_RUNTIME_ENV = {"env_vars": {**serve_transport.REPLICA_ENV,
                                   ray_private.SETUP_HOOK_ENV_VAR: "rayrunner.runtime.preload.serving_setup"}}
KEEP_ALIVE_S = 600
WARM_MARGIN_S = 1.0  # a replica whose process is this much older than its deploy ran in a waiting worker
# A spare is asked for this long after the load, once the requests that waited for the model have their first
# answers: a worker process starting (Python and Ray, before its imports drop to nice +10) took SmolLM2's first
# answer after a stop from 0.1 s to 0.3-0.45 s on a 2-core box when asked for at once. Not longer: the spare imports
# for ~5 s there, and a user switching to another new model within that starts it in a half-ready worker.
SPARE_DELAY_S = 1.0


def prestart_worker(worker: dict[str, Any], keep_alive_s: int = KEEP_ALIVE_S, count: int = 1) -> bool:
    """Ask the raylet of the replica's node to start `count` idle workers with the replica's job and runtime env;
    False when that node is gone (nothing to ask)."""
    import ray

    node = next((n for n in ray.nodes() if n["NodeID"] == worker["node_id"] and n["Alive"]), None)
    if node is None:
        return False
    ray_private.prestart_workers(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}", worker["job_id"],
                                 worker["runtime_env"], keep_alive_s, count)
    return True


class WarmSpares:
    """Keeps `per_node` spare workers waiting on each node that runs models (see the module docstring)."""

    def __init__(self, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        self.keep_alive_s = keep_alive_s
        self.waiting: dict[str, list[float]] = {}  # node id -> when each spare asked for there stops being kept
        self.broken = False  # the raylet call failed once: no more tries

    def after_deploy(self, worker: dict[str, Any], deployed_at: float, per_node: int = 1) -> None:
        """After a model deployed, given its replica's `ModelServer.worker()`: count the spare it took (if any)
        and ask for the next ones where needed."""
        node_id, started_at = worker.get("node_id"), worker.get("process_started_at")
        if self.broken or not isinstance(node_id, str) or not isinstance(started_at, int | float):
            return
        waiting = self._waiting(node_id)
        if started_at < deployed_at - WARM_MARGIN_S:
            if waiting:
                waiting.pop(0)  # it ran in a waiting worker: ours, most likely
        elif waiting:
            return  # a fresh process although spares wait there: they do not fit; do not pile up more
        self._fill(worker, node_id, per_node)

    def after_adopt(self, worker: dict[str, Any], per_node: int = 1) -> None:
        """After a model loaded by a deploy not the registry's own (a config's, at start): spares for its node,
        up to `per_node` waiting there."""
        node_id = worker.get("node_id")
        if self.broken or not isinstance(node_id, str):
            return
        self._fill(worker, node_id, per_node)

    def _waiting(self, node_id: str) -> list[float]:
        now = time.time()
        self.waiting[node_id] = [until for until in self.waiting.get(node_id, []) if until > now]
        return self.waiting[node_id]

    def _fill(self, worker: dict[str, Any], node_id: str, per_node: int) -> None:
        missing = per_node - len(self._waiting(node_id))
        if missing <= 0:
            return
        now = time.time()
        try:
            started = prestart_worker(worker, self.keep_alive_s, missing)
        except Exception as exc:
            self.broken = True
            logger.warning("rayrunner could not start a spare worker (loads start cold): %s", exc)
            return
        if started:
            self.waiting[node_id].extend([now + self.keep_alive_s] * missing)
