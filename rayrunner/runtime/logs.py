"""rayrunner's own log lines in a Serve replica's log file, and the registry actor's in a file of its own.

Serve writes only the `ray.serve` logger to `logs/serve/replica_<app>_<deployment>_<id>.log`; INFO lines of other
loggers are dropped. Replicas (router and model servers) call `to_replica_log` at start, so rayrunner's loggers
(load phases, wake-ups, quantization, config changes) land in the same file, with Serve's format and request ids.
The registry is a plain actor, outside Serve's logging: `to_actor_log` sends its lines (loads, evictions and
why, config changes) to a file beside its state file and to the actor's stderr (the dashboard's actor logs).
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def to_replica_log() -> None:
    serve_logger = logging.getLogger("ray.serve")
    ours = logging.getLogger("rayrunner")
    ours.setLevel(logging.INFO)
    for handler in serve_logger.handlers:
        if handler not in ours.handlers:
            ours.addHandler(handler)
    ours.propagate = not serve_logger.handlers  # outside a replica: the usual handlers


def to_actor_log(path: Path) -> None:
    ours = logging.getLogger("rayrunner")
    ours.setLevel(logging.INFO)
    path.parent.mkdir(parents=True, exist_ok=True)
    for handler in (logging.handlers.RotatingFileHandler(path, maxBytes=16 * 2**20, backupCount=2),
                    logging.StreamHandler()):
        handler.setFormatter(logging.Formatter(_FORMAT))
        ours.addHandler(handler)
    ours.propagate = False
