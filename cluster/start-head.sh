#!/usr/bin/env bash
# Start the Ray head node for rayrunner (dashboard on: unload scales models through it).
set -euo pipefail
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0
# Idle workers import the model stack, so a model loaded again starts warm (rayrunner/warm_workers.py).
export RAY_preload_python_modules="${RAY_preload_python_modules-rayrunner.worker_preload}"
# Serve's proxy reaches the router over gRPC, and replicas take large requests (rayrunner/serve_transport.py).
export RAY_SERVE_PROXY_USE_GRPC="${RAY_SERVE_PROXY_USE_GRPC-1}"
export RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH="${RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH-1073741824}"
exec ray start --head --port=6379 --dashboard-host=0.0.0.0 --dashboard-port=8265 "$@"
