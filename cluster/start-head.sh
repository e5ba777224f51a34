#!/usr/bin/env bash
# Start the Ray head node for rayrunner (dashboard on: unload scales models through it).
set -euo pipefail
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/cluster_env.sh"  # warm spares, Serve's hops over gRPC
exec ray start --head --port=6379 --dashboard-host=0.0.0.0 --dashboard-port=8265 "$@"
