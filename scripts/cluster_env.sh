# Sourced where a rayrunner cluster's Ray starts (scripts/install.sh, cluster/start-head.sh, start-worker.sh): the
# environment `rayrunner.runtime.warm_workers.CLUSTER_ENV` gives the clusters rayrunner starts itself; a value already set wins.
# Idle workers import the model stack, so a model loaded again starts warm (rayrunner/runtime/warm_workers.py); Serve's
# proxy reaches the router over gRPC unless RAYRUNNER_SERVE_GRPC=0, and replicas take large requests
# (rayrunner/runtime/transport.py).
export RAY_preload_python_modules="${RAY_preload_python_modules-rayrunner.runtime.preload}"
# Workers (replicas, router, proxy) at the node's normal priority, not Ray's nice 15 (rayrunner/runtime/warm_workers.py).
export RAY_worker_niceness="${RAY_worker_niceness-0}"
[ "${RAYRUNNER_SERVE_GRPC-1}" = 0 ] && proxy_grpc=0 || proxy_grpc=1
export RAY_SERVE_PROXY_USE_GRPC="${RAY_SERVE_PROXY_USE_GRPC-$proxy_grpc}"
export RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH="${RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH-1073741824}"
