"""rayrunner's own log lines in a Serve replica's log file.

Serve writes only the `ray.serve` logger to `logs/serve/replica_<app>_<deployment>_<id>.log`; INFO lines of other
loggers are dropped. Replicas (router and model servers) call `to_replica_log` at start, so rayrunner's loggers
(load phases, wake-ups, quantization, config changes) land in the same file, with Serve's format and request ids.
"""

from __future__ import annotations

import logging


def to_replica_log() -> None:
    serve_logger = logging.getLogger("ray.serve")
    ours = logging.getLogger("rayrunner")
    ours.setLevel(logging.INFO)
    for handler in serve_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = not serve_logger.handlers  # outside a replica: the usual handlers
