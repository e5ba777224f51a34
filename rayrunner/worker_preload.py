"""What a model replica's worker imports when it starts, before it runs anything: torch, transformers and
rayrunner's model server (~4 s on a small CPU box).

Ray imports this module in every Python worker of a cluster started with
`RAY_preload_python_modules=rayrunner.worker_preload` (see `rayrunner.warm_workers`). Only workers started for
model replicas, and the spare workers started for them, carry `RAYRUNNER_PRELOAD=1` in their runtime env: they
import the model stack here, in the main thread before the worker takes any task, so a spare waits fully imported
and a replica given to it starts at once. Every other worker (Serve's controller and proxy, the router, the
registry) imports nothing here. Importing in the main thread matters: transformers' lazy modules are not safe to
import from two threads at once.
"""

from __future__ import annotations

import importlib
import logging
import os

from rayrunner.warm_workers import PRELOAD_ENV_VAR  # (it imports nothing of rayrunner's: no cycle)

MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",  # what AutoProcessor/AutoTokenizer pull in on a replica's first load
    "rayrunner.deployments.model_server",
    "rayrunner.deployments.text_engine",
)

logger = logging.getLogger(__name__)


def preload() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # a missing optional piece must never break a worker
            logger.warning("rayrunner could not preload %s", name, exc_info=True)


if os.environ.get(PRELOAD_ENV_VAR) == "1":
    preload()
