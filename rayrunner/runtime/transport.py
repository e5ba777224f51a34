"""How Serve carries rayrunner's requests between its processes: over Serve's direct gRPC channels between
replicas rather than as Ray actor calls through the object store.

Every token of a stream crosses two Serve hops (proxy -> router replica -> model replica), each once per chunk.
On a small box those hops' CPU is taken from the model's compute threads, so they cost generation speed. Ray
Serve 2.60 can send a handle's calls over a gRPC channel to the replica instead (`_by_reference=False`; what its
"throughput optimized" mode turns on for all handles), and its proxy can do the same (`RAY_SERVE_PROXY_USE_GRPC`);
docs/performance.md has what that gains (`bench/bench_transport.py`).

A replica's gRPC server takes messages up to `RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH` (4 MB by default, read when
the replica's process starts), less than a chat with a large image or a long batch of embeddings: `REPLICA_ENV`
raises it for rayrunner's own replicas (router and models), whatever cluster they run on. The proxy's switch is read
by the proxy's process, so it is part of the environment of the clusters rayrunner starts (`CLUSTER_ENV`); on a
cluster started without it the proxy's hop stays a Ray actor call, which works the same, a little slower.

`RAYRUNNER_SERVE_GRPC=0` in the cluster's environment keeps both hops Ray actor calls (a multi-node cluster whose
nodes cannot reach each other's replica gRPC ports; `bench/bench_transport.py` compares the two).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported early (`warm_workers`), before anything needs Serve
    from ray.serve.handle import DeploymentHandle

SWITCH = "RAYRUNNER_SERVE_GRPC"
ENABLED = os.environ.get(SWITCH, "1") != "0"
MAX_MESSAGE_BYTES = 1 << 30
REPLICA_ENV = {"RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(MAX_MESSAGE_BYTES)}
CLUSTER_ENV = {"RAY_SERVE_PROXY_USE_GRPC": "1" if ENABLED else "0", **REPLICA_ENV}


def direct(handle: DeploymentHandle) -> DeploymentHandle:
    """`handle` with its calls sent over the replica's gRPC channel (see the module docstring)."""
    return handle.options(_by_reference=False) if ENABLED else handle
