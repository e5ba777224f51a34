"""What a model replica's worker imports when it starts, before it runs anything: torch, transformers and
rayrunner's model server (~4 s on a small CPU box).

Ray runs `worker_setup` in every worker started for a model replica (and the spare workers started for them), and
imports this module in every Python worker of a cluster started with
`RAY_preload_python_modules=rayrunner.runtime.preload` (see `rayrunner.runtime.warm_workers`). Only workers started for
model replicas carry `RAYRUNNER_PRELOAD=1` in their runtime env: they import the model stack here, in the main
thread before the worker takes any task, so a spare waits fully imported and a replica given to it starts at once.
Every other worker (Serve's controller and proxy, the router, the registry) imports nothing here. Importing in the
main thread matters: transformers' lazy modules are not safe to import from two threads at once.

The imports run at a lower CPU priority (nice +10) when the process may raise it back afterwards (CAP_SYS_NICE,
or an `RLIMIT_NICE` that allows it): a spare started after a load then yields the CPU to the replicas serving their
first requests instead of slowing them down for the ~4 s it imports.

Then it builds what transformers otherwise builds at a process's first load, and what was imported is collected
once and frozen (`gc.freeze`): Serve collects and freezes at a replica's start
(`RAY_SERVE_FREEZE_GC_ON_STARTUP`), between its constructor and its first health check, and a full collection over
the imported stack takes ~0.3 s on a 2-core box; over what the replica made since the freeze, ~0.01 s.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import logging
import os
import resource
from collections.abc import Iterator

from rayrunner.runtime.warm_workers import PRELOAD_ENV_VAR  # (it imports nothing of rayrunner's: no cycle)

MODULES = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.processing_utils",  # what AutoProcessor/AutoTokenizer pull in on a replica's first load
    "transformers.generation",
    "transformers.masking_utils",
    "transformers.models.llama.modeling_llama",  # the builtin model's architecture, and many others'
    "rayrunner.replica.model_server",
    "rayrunner.engines.transformers.text",
)

IMPORT_NICENESS = 10
CAP_SYS_NICE = 23  # the capability's bit in /proc/<pid>/status

logger = logging.getLogger(__name__)


_preloaded = False


def worker_setup() -> None:
    """Ray's setup hook of model replica workers (`warm_workers.REPLICA_RUNTIME_ENV`): serve at the node's normal
    priority, then import the stack."""
    serving_setup()
    preload()


def serving_setup() -> None:
    """Ray's setup hook of the router's workers (`warm_workers.ROUTER_RUNTIME_ENV`), and part of `worker_setup`:
    serve at the node's normal priority (Ray starts workers at nice 15 unless `RAY_worker_niceness` says otherwise,
    and every token crosses the router)."""
    niceness = os.getpriority(os.PRIO_PROCESS, 0)
    if niceness > 0 and _may_set_niceness(0):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def preload() -> None:
    """Import the model stack, once per process (through Ray's preload and the setup hook alike)."""
    global _preloaded
    if _preloaded:
        return
    _preloaded = True
    with lower_priority(IMPORT_NICENESS):
        for name in MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # a missing optional piece must never break a worker
                logger.warning("rayrunner could not preload %s", name, exc_info=True)
        _build_transformers_caches()
        gc.collect()
        gc.freeze()  # the imported stack lives as long as the process: no later collection walks it again


def _build_transformers_caches() -> None:
    """What transformers builds once per process at its first `from_pretrained`: the checkpoint conversion
    mapping of every architecture (~950 regexes compiled, 0.25 s of a 0.6 s first load on a 2-core box)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping("llama")
    except Exception:  # another transformers version: the first load builds what it needs, as before
        logger.debug("transformers' conversion mapping not prebuilt", exc_info=True)


@contextlib.contextmanager
def lower_priority(increment: int) -> Iterator[None]:
    """Run the block `increment` nice levels lower, only when the process can return to its priority after it
    (otherwise at its own priority: a replica must never be left slower than its peers)."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if not _may_set_niceness(before):
        yield
        return
    os.setpriority(os.PRIO_PROCESS, 0, before + increment)
    try:
        yield
    finally:
        for thread in _thread_ids():  # threads started inside took the lower priority too (Linux: per thread)
            with contextlib.suppress(OSError):  # one that has exited meanwhile
                os.setpriority(os.PRIO_PROCESS, thread, before)


def _thread_ids() -> list[int]:
    """This process's threads (only the calling one where /proc is missing)."""
    try:
        return [int(name) for name in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def _may_set_niceness(niceness: int) -> bool:
    """Whether this process may lower its niceness to `niceness`: its RLIMIT_NICE allows it (the limit is
    20 - niceness), or it holds CAP_SYS_NICE (root in a container may not)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or 20 - niceness <= soft:
        return True
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False


if os.environ.get(PRELOAD_ENV_VAR) == "1":
    preload()
