#!/usr/bin/env bash
# Start the Ray head node for rayrunner (dashboard on: unload scales models through it, from the registry actor,
# which runs on this node).
# The dashboard listens on 127.0.0.1 only: whoever reaches it can submit jobs, that is run any code on every node.
# Reach it through a tunnel (`ssh -L 8265:127.0.0.1:8265 <head>`); pass `--dashboard-host=0.0.0.0` only on a
# network where every host is trusted, or with Ray's token auth: RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN
# (from `ray get-auth-token --generate`) in the environment of this script, start-worker.sh and every driver.
set -euo pipefail
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}" RAY_USAGE_STATS_ENABLED=0
source "$(dirname "${BASH_SOURCE[0]}")/../scripts/cluster_env.sh"  # warm spares, Serve's hops over gRPC
exec ray start --head --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265 "$@"
