"""What a Ray worker imports ahead of time so that a model replica given to it starts without the import wait.

A cluster started with `RAY_preload_python_modules=rayrunner.worker_preload` (see `rayrunner.warm_workers`) has
every Python worker import this module when it starts. Importing it costs nothing: a daemon thread waits, and only
when the worker is still idle after `IDLE_S` (no actor created in it) does it import the model stack (torch,
transformers, rayrunner's model server and text engine: ~4 s and ~265 MB on a small CPU box). Workers that are taken
at once by Serve's controller, proxy or the router never pay for it; a spare that waits for the next model replica
has everything imported when the replica arrives. A worker taken while it is importing finishes the imports (the
replica's own imports wait on them), which is still sooner than starting cold.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

IDLE_S = 5.0  # how long a worker must sit unused before it imports (Serve's own actors take workers sooner)
POLL_S = 0.5
MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",  # what AutoProcessor/AutoTokenizer pull in on a replica's first load
    "rayrunner.deployments.model_server",
    "rayrunner.deployments.text_engine",
)

logger = logging.getLogger(__name__)


def _idle() -> bool:
    """Whether no actor lives in this worker yet. Read from Python state only: asking Ray's core worker for the
    current task from this thread, before a job is assigned, aborts the whole process."""
    from ray._private.worker import global_worker

    return not global_worker.actors


def _preload_when_idle() -> None:
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < IDLE_S:
        time.sleep(POLL_S)
        if not _idle():
            return  # taken by an actor: it imports what it needs itself
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # a missing optional piece must never break a worker
            logger.warning("rayrunner could not preload %s", name, exc_info=True)


threading.Thread(target=_preload_when_idle, name="rayrunner-preload", daemon=True).start()
