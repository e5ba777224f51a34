"""The local cluster both serving benchmarks run on: Ray with the dashboard (unload needs its scaling API) and
Serve, on free ports in 30000-32000 so a benchmark never collides with the test suite (20000-30000).

`start_cluster` sets Ray's environment (no token auth, no usage stats, normal worker priority, offline hub)
before the cluster starts; Ray reads these when it starts, not when it is imported. vLLM's CPU thread settings
(`VLLM_CPU_*`) in the driver's environment reach every replica.
"""

from __future__ import annotations

import os
import random
import socket

from rayrunner.runtime.warm_workers import CLUSTER_ENV

_RAY_ENV = {
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_worker_niceness": "0",
    "HF_HUB_OFFLINE": "1",
    **CLUSTER_ENV,  # warm spare workers, as scripts/install.sh sets
}


def free_port(used: set[int]) -> int:
    for port in random.sample(range(30000, 32000), 200):
        if port in used:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        used.add(port)
        return port
    raise RuntimeError("no free port in 30000-32000")


def start_cluster(dashboard_port: int | None = None, http_port: int | None = None) -> str:
    """Start Ray and Serve; returns the HTTP base URL."""
    import ray
    from ray import serve

    for key, value in _RAY_ENV.items():
        os.environ.setdefault(key, value)
    used: set[int] = set()
    dashboard_port = dashboard_port or free_port(used)
    http_port = http_port or free_port(used)
    env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "HF_HUB_OFFLINE")}
    env.update({key: value for key, value in os.environ.items() if key.startswith("VLLM_CPU_")})
    if os.environ.get("RAYRUNNER_CACHE_DIR"):
        env["RAYRUNNER_CACHE_DIR"] = os.environ["RAYRUNNER_CACHE_DIR"]
    # The node's own CPU count, as `serve run serve_config.yaml` starts Ray on it: replicas' reservations bind as
    # they would for a user.
    ray.init(address="local", num_cpus=os.cpu_count() or 1, include_dashboard=True, dashboard_port=dashboard_port,
             runtime_env={"env_vars": env}, logging_level="WARNING", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port}, logging_config={"enable_access_log": False})
    return f"http://127.0.0.1:{http_port}"
