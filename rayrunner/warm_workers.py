"""Warm spare workers: a model stopped and loaded again starts in a process that has already imported its stack.

Measured on a 2-core CPU box (`bench/bench_lifecycle.py`): a replica's weights load in 0.3-0.7 s, but a reload
after a `stop` took 6-7 s, of which ~5 s went to the new worker process: Python and Ray start, then torch,
transformers and rayrunner's model server import. Ray gives a new actor an idle worker of the same job and runtime
env when the node has one, so:

- a cluster started by rayrunner (its scripts, the Runner's own cluster, the tests) sets `CLUSTER_ENV`, which makes
  every worker import `rayrunner.worker_preload`: an idle worker imports the model stack after a few seconds;
- after each deploy of a model, the registry asks that node's raylet for one spare worker of the registry's job and
  runtime env (which Serve's replicas share), kept alive `KEEP_ALIVE_S` (`WarmSpares`). The next replica started
  on the node takes it.

Ray 2.60 has no public Python API for the raylet's PrestartWorkers call, so it goes through Ray's generated gRPC
stub; if that fails, a warning is logged once and loads start cold, as before. At most one spare per node waits: a
deploy that ran in a fresh process while a spare was waiting means the spare did not fit (e.g. a model app with a
runtime_env of its own), and no other is asked for on that node until the waiting one's keep-alive ends.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

logger = logging.getLogger(__name__)

PRELOAD_MODULE = "rayrunner.worker_preload"
CLUSTER_ENV = {"RAY_preload_python_modules": PRELOAD_MODULE}  # read by the raylet when the cluster starts
KEEP_ALIVE_S = 600
WARM_MARGIN_S = 1.0  # a replica whose process is this much older than its deploy ran in a waiting worker


def prestart_worker(node_id: str, keep_alive_s: int = KEEP_ALIVE_S) -> None:
    """Ask the raylet of `node_id` to start one idle worker for this caller's job and runtime env."""
    import ray
    from ray._private.grpc_utils import init_grpc_channel
    from ray.core.generated import common_pb2, node_manager_pb2, node_manager_pb2_grpc, runtime_environment_pb2

    common, manager, runtime_env = cast(Any, (common_pb2, node_manager_pb2, runtime_environment_pb2))  # no stubs
    context = ray.get_runtime_context()
    node = next(n for n in ray.nodes() if n["NodeID"] == node_id and n["Alive"])
    channel = init_grpc_channel(f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}")
    try:
        env = runtime_env.RuntimeEnvInfo(serialized_runtime_env=context.get_runtime_env_string())
        request = manager.PrestartWorkersRequest(
            language=common.PYTHON, job_id=bytes.fromhex(context.get_job_id()), runtime_env_info=env,
            keep_alive_duration_secs=keep_alive_s, num_workers=1)
        node_manager_pb2_grpc.NodeManagerServiceStub(channel).PrestartWorkers(request, timeout=10)
    finally:
        channel.close()


class WarmSpares:
    """Keeps one spare worker waiting on each node that runs models (see the module docstring)."""

    def __init__(self, keep_alive_s: int = KEEP_ALIVE_S) -> None:
        self.keep_alive_s = keep_alive_s
        self.waiting_until: dict[str, float] = {}  # node id -> when the spare asked for there stops being kept
        self.broken = False  # the raylet call failed once: no more tries

    def after_deploy(self, info: dict[str, Any], deployed_at: float) -> None:
        """After a model deployed: count the spare it took (if any) and ask for the next one where needed."""
        node_id, process_started_at = info.get("node_id"), info.get("process_started_at")
        if self.broken or not isinstance(node_id, str) or not isinstance(process_started_at, int | float):
            return
        now = time.time()
        if process_started_at < deployed_at - WARM_MARGIN_S:
            self.waiting_until.pop(node_id, None)  # it ran in a waiting worker: ours, most likely
        elif self.waiting_until.get(node_id, 0.0) > now:
            return  # a fresh process although a spare waits there: it does not fit; do not pile up another
        try:
            prestart_worker(node_id, self.keep_alive_s)
        except Exception as exc:
            self.broken = True
            logger.warning("rayrunner could not start a spare worker (loads start cold): %s", exc)
            return
        self.waiting_until[node_id] = now + self.keep_alive_s
