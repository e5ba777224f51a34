#!/usr/bin/env bash
# Join a worker node (GPUs are detected by Ray) to the head given as HOST:PORT.
set -euo pipefail
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/cluster_env.sh"  # warm spares, Serve's hops over gRPC
exec ray start --address="${1:?usage: start-worker.sh HEAD_HOST:6379}" "${@:2}"
