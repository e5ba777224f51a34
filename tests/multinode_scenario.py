"""Multi-node scenario on a simulated cluster (`ray.cluster_utils.Cluster`): placement, refusal and failover.

Run by tests/integration/test_multinode.py in its own process, since it starts its own Ray cluster: a head (CPU
only) and two worker nodes whose GPUs are declared (Ray lets a node declare `num_gpus` it does not have, as Ray's
own tests do; torch finds no CUDA, so the replicas run on CPU) with `accelerator_type:<T>` resources standing in
for their GPU types. It checks that
1. each model's replica runs on the node its `num_gpus` / `accelerator_type` / `memory` / `resources` demand, with
   those options on the replica actor (a replica of two GPUs on the node that has two);
2. a model asking for an accelerator type no node has fails its load at once with `unplaceable_model`, naming the
   missing resource and the nodes, and its card shows `unloaded` with `last_error`;
3. after the node holding a model is removed, a request for it waits, and succeeds once a node that fits joins
   and Serve has placed a new replica there (on that node).

    python tests/multinode_scenario.py MODEL_DIR STATE_DIR

Exits 0 when every check passes; otherwise prints `FAILED: <why>` and exits 1. Ray's files go under a private
`RAY_TMPDIR` (set here unless given), so this cluster never becomes the machine's "current" Ray cluster.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_worker_niceness", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Short, for Ray's socket paths under it; made here (and removed at exit) unless the caller gave one.
OWN_TMPDIR = None if "RAY_TMPDIR" in os.environ else tempfile.mkdtemp(prefix="rrmn", dir="/tmp")
os.environ.setdefault("RAY_TMPDIR", OWN_TMPDIR or "")

import httpx  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from rayrunner.registry.actor import NAMESPACE, registry_name  # noqa: E402
from rayrunner.router.app import build_router_app  # noqa: E402

MIB = 1024**2
A10G: dict[str, Any] = {"num_cpus": 1, "num_gpus": 1, "resources": {"accelerator_type:A10G": 1}}
L4: dict[str, Any] = {
    "num_cpus": 1, "num_gpus": 1, "memory": 1024 * MIB, "resources": {"accelerator_type:L4": 1, "nvme": 1}
}
DUAL: dict[str, Any] = {"num_cpus": 1, "num_gpus": 2}
# Engine settings: each model pins itself to one node type through the settings this scenario is about.
ENGINES: dict[str, dict[str, Any]] = {
    "on-a10g": {"num_gpus": 1, "accelerator_type": "A10G", "num_cpus": 0.5, "torch_threads": 1},
    "on-l4": {"num_gpus": 1, "accelerator_type": "L4", "memory": 256 * MIB, "resources": {"nvme": 1},
              "num_cpus": 0.5, "torch_threads": 1},
    "on-h100": {"num_gpus": 1, "accelerator_type": "H100", "num_cpus": 0.5},
    "on-dual": {"num_gpus": 2, "num_cpus": 0.5, "torch_threads": 1},
}
STEP_TIMEOUT_S = 120.0


class ScenarioFailed(Exception):
    pass


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ScenarioFailed(message)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = STEP_TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.5)
    raise ScenarioFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def router_config(model_dir: str, state_dir: str) -> dict[str, Any]:
    def entry(model_id: str, load: bool) -> dict[str, Any]:
        spec = {"model_id": model_id, "which": {"type": "plain", "model_id": model_dir}, "engine": ENGINES[model_id]}
        return {"spec": spec, "load": load}

    models = [entry("on-a10g", True), entry("on-l4", True), entry("on-h100", False), entry("on-dual", True)]
    return {"models": models, "state_path": os.path.join(state_dir, "registry.json"), "load_timeout_s": 300}


def replica_actor(model_id: str) -> dict[str, Any] | None:
    """The model's alive replica actor from the GCS actor table (no dashboard needed)."""
    for actor in ray._private.state.actors().values():
        if actor["ActorClassName"].startswith(f"ServeReplica:{model_id}:") and actor["State"] == "ALIVE":
            return dict(actor)
    return None


def actor_node(name: str, namespace: str) -> str:
    actor_id = ray.get_actor(name, namespace=namespace)._actor_id.hex()
    return str(ray._private.state.actors(actor_id)["Address"]["NodeID"])


def is_loaded(http: httpx.Client, model_id: str) -> bool:
    return bool(http.get(f"/v1/models/{model_id}").json().get("status") == "loaded")


def chat(http: httpx.Client, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    return http.post("/v1/chat/completions", json=body)


def check_placement(nodes: dict[str, str]) -> None:
    """Each model's replica on the node its settings demand, carrying those settings as Ray resources."""
    for model_id, node in (("on-a10g", "a10g"), ("on-l4", "l4"), ("on-dual", "dual")):
        actor = wait_for(f"`{model_id}`'s replica", partial(replica_actor, model_id))
        where = nodes.get(actor["Address"]["NodeID"], actor["Address"]["NodeID"])
        check(where == node, f"`{model_id}` runs on node {where}, expected {node}")
        log(f"`{model_id}` runs on node {where}")
    l4 = next(node_id for node_id, name in nodes.items() if name == "l4")
    free = ray._private.state.available_resources_per_node()[l4]
    log(f"node l4 has free: GPU {free.get('GPU', 0)}, nvme {free.get('nvme', 0)}, memory {free['memory'] / MIB} MiB")
    check(free.get("GPU", 0) == 0 and free.get("nvme", 0) == 0 and free["memory"] == L4["memory"] - 256 * MIB,
          "`on-l4`'s replica should reserve node l4's GPU, its nvme and 256 MiB of its memory")
    dual = next(node_id for node_id, name in nodes.items() if name == "dual")
    check(ray._private.state.available_resources_per_node()[dual].get("GPU", 0) == 0,
          "`on-dual`'s replica should reserve both of node dual's GPUs")


def check_unplaceable(http: httpx.Client) -> None:
    """An absent accelerator type: refused at once with a clear error; the model stays unloaded."""
    started = time.monotonic()
    response = http.post("/v1/models/reload", json={"model_id": "on-h100"})
    elapsed = time.monotonic() - started
    log(f"reload on-h100: HTTP {response.status_code} in {elapsed:.1f} s: {response.text}")
    error = response.json().get("error", {})
    check(elapsed < 30, f"the refusal took {elapsed:.1f} s; it should be immediate")
    message = error.get("message", "")
    check("accelerator_type:H100" in message and "accelerator_type:A10G" in message
          and "accelerator_type:L4" in message, f"the error should name the missing type and the nodes': {message}")
    check(response.status_code == 400 and error.get("code") == "unplaceable_model",
          f"expected HTTP 400 `unplaceable_model`, got {response.status_code} `{error.get('code')}`")
    card = http.get("/v1/models/on-h100").json()
    check(card.get("status") == "unloaded", f"the card should say unloaded: {card}")
    check("accelerator_type:H100" in (card.get("last_error") or ""), f"last_error should say why: {card}")


def check_failover(cluster: Cluster, workers: dict[str, Any], nodes: dict[str, str], http: httpx.Client) -> None:
    """A second A10G node joins; the node holding `on-a10g` is removed; a request sent once Serve has seen the
    replica die waits while Serve places a new one on the node that fits, then succeeds."""
    workers["a10g-2"] = cluster.add_node(**A10G)
    nodes[workers["a10g-2"].node_id] = "a10g-2"
    cluster.remove_node(workers.pop("a10g"))
    log("added node a10g-2, removed node a10g")
    wait_for("Serve to see the replica gone", lambda: replica_actor("on-a10g") is None)
    started = time.monotonic()
    response = chat(http, "on-a10g")
    log(f"a request sent then: HTTP {response.status_code} after {time.monotonic() - started:.1f} s")
    check(response.status_code == 200, f"the request failed: {response.status_code} {response.text}")
    actor = replica_actor("on-a10g")
    where = actor and nodes.get(actor["Address"]["NodeID"])
    check(where == "a10g-2", f"`on-a10g` should now run on a10g-2, not {where}")
    log(f"`on-a10g` runs on node {where}")


def run(model_dir: str, state_dir: str) -> None:
    env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "HF_HUB_OFFLINE")}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    assert cluster.head_node is not None
    workers = {"a10g": cluster.add_node(**A10G), "l4": cluster.add_node(**L4), "dual": cluster.add_node(**DUAL)}
    nodes = {cluster.head_node.node_id: "head", **{node.node_id: name for name, node in workers.items()}}
    ray.init(address=cluster.address, runtime_env={"env_vars": env}, logging_level=logging.WARNING, log_to_driver=False)
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"enable_access_log": False})
        started = time.monotonic()
        serve.run(build_router_app(router_config(model_dir, state_dir)), name="rayrunner", route_prefix="/")
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=STEP_TIMEOUT_S * 2)
        for model_id in ("on-a10g", "on-l4", "on-dual"):
            wait_for(f"`{model_id}` to load", partial(is_loaded, http, model_id))
            response = chat(http, model_id)
            check(response.status_code == 200, f"chat with `{model_id}`: {response.status_code} {response.text}")
        log(f"the models loaded and answered in {time.monotonic() - started:.1f} s")
        router = replica_actor("rayrunner")
        log(f"registry on node {nodes.get(actor_node(registry_name(), NAMESPACE))}, router on node "
            f"{router and nodes.get(router['Address']['NodeID'])}; state file {state_dir}")
        head = next(node for node in ray.nodes() if node["NodeID"] == cluster.head_node.node_id)
        log(f"head node resources: {sorted(head['Resources'])}")
        check_placement(nodes)
        check_unplaceable(http)
        check_failover(cluster, workers, nodes, http)
        log("registry now on node " + str(nodes.get(actor_node(registry_name(), NAMESPACE))))
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def main() -> int:
    model_dir, state_dir = sys.argv[1], sys.argv[2]
    started = time.monotonic()
    passed = False
    try:
        run(model_dir, state_dir)
        passed = True
    except ScenarioFailed as exc:
        print(f"FAILED: {exc}", flush=True)
    finally:
        if not passed:
            print(f"[logs] Ray's logs are kept in {os.environ['RAY_TMPDIR']}/ray/session_latest/logs", flush=True)
        elif OWN_TMPDIR:
            shutil.rmtree(OWN_TMPDIR, ignore_errors=True)
    if passed:
        log(f"PASSED in {time.monotonic() - started:.1f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
