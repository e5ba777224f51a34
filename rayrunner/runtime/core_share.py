"""Cores shared, not fought over: the node's cores divided among the engines that are busy right now.

Every engine on a node decodes with torch's OpenMP pool. When two busy replicas each size it to the node's core
count, their workers outnumber the cores and spin-wait at barriers for peers that are descheduled, and both slow to
a fraction of either alone (figures: docs/performance.md, "Sharing the cores"). A fixed count is no answer either: a
model busy alone should use the node.

The engines divide the node's cores less those left to the serving path (`serving_cores`). Each engine holds a
lease, a file in a node-local folder (`/dev/shm`), whose modification time it refreshes while it has work (at most
every `REFRESH_S`). Before each unit of work it sizes its pool to its share: those cores divided among the engines
whose lease is fresh (refreshed in the last `STALE_S`), the remainder going to the first in
lease order, at least one thread each. An engine that goes idle drops its lease, so the others grow back at their
next refresh. A killed replica's lease is dropped by the next engine that counts (its process is gone). The sum of
busy engines' threads thus never exceeds the cores (once every engine has seen the newest lease, within
`REFRESH_S`), unless there are more busy engines than cores, where each keeps one thread.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

REFRESH_S = 0.1  # how often a busy engine touches its lease and recounts its peers
# A lease not refreshed for this long belongs to an engine gone idle without saying so (a busy one refreshes between
# steps, and one step, a long prefill chunk on a loaded node, can take seconds).
STALE_S = 5.0
SWEEP_S = 60.0  # a lease this old is deleted by whoever sees it
# Cores left to the serving path (every token also crosses the proxy, the router and the replica's event loop, and
# a client or tokenizer may run on the node): none on a node of `SMALL_NODE` cores or fewer, where the path needs
# far less than a core and a model busy alone decodes faster on all of them; one on larger nodes, where a core is a
# small share and more OpenMP workers wait longer at each barrier for one the serving path took (figures:
# docs/performance.md, "Sharing the cores"). `RAYRUNNER_SERVING_CORES` sets it.
SMALL_NODE = 2
SERVING_CORES_ENV = "RAYRUNNER_SERVING_CORES"
_numbers = itertools.count()  # of the leases of this process (`<pid>-<number>`)


def default_folder() -> Path:
    """Node-local and shared by every process of the node: `/dev/shm` where there is one (memory, no disk writes)."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return root / f"rayrunner-cores-{os.getuid()}"


def node_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def serving_cores(cores: int) -> int:
    """The cores of a node of `cores` left to the serving path (see `SMALL_NODE`), or `RAYRUNNER_SERVING_CORES`."""
    setting = os.environ.get(SERVING_CORES_ENV, "").strip()
    if setting:
        if not setting.isdigit():
            raise ValueError(f"{SERVING_CORES_ENV}={setting!r} is not a number of cores")
        return int(setting)
    return 0 if cores <= SMALL_NODE else 1


def engine_cores() -> int:
    """The node's cores less `serving_cores` (at least one): what its busy engines divide among themselves."""
    cores = node_cores()
    return max(1, cores - serving_cores(cores))


class CoreShare:
    """One engine's lease on the node's cores. `working()` before each unit of work returns the threads it may use
    now; `idle()` when it has none left. Not thread-safe: call both from the engine's compute thread."""

    def __init__(self, cap: int | None = None, cores: int | None = None, folder: Path | None = None) -> None:
        self.cap = cap
        self.cores = cores or max(engine_cores(), cap or 1)  # a cap set by hand may take the serving core
        self.folder = folder or default_folder()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.lease = self.folder / f"{os.getpid()}-{next(_numbers)}"
        self.threads = self._limit(self.cores)
        self._checked_at = 0.0

    def working(self) -> int:
        """Refresh the lease and recount the busy engines (at most every `REFRESH_S`); the threads to use now."""
        now = time.time()
        if now - self._checked_at >= REFRESH_S:
            self._checked_at = now
            self._touch()
            self.threads = self._limit(self._share(now))
        return self.threads

    def _touch(self) -> None:
        """Refresh the lease, making the folder again if something deleted it (a /dev/shm or /tmp clean-up)."""
        try:
            self.lease.touch()
        except FileNotFoundError:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.lease.touch()

    def idle(self) -> None:
        """Give the cores back: the other busy engines take them at their next refresh."""
        self._checked_at = 0.0
        with contextlib.suppress(FileNotFoundError):
            self.lease.unlink()

    def _share(self, now: float) -> int:
        busy = sorted(self._busy_leases(now) | {self.lease.name})
        rank = busy.index(self.lease.name)
        whole, rest = divmod(self.cores, len(busy))
        return whole + (1 if rank < rest else 0)

    def _busy_leases(self, now: float) -> set[str]:
        busy = set()
        for lease in os.scandir(self.folder):
            try:
                age = now - lease.stat().st_mtime
            except FileNotFoundError:  # dropped meanwhile
                continue
            if age > SWEEP_S or not _alive(lease.name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lease.path)
            elif age < STALE_S:
                busy.add(lease.name)
        return busy

    def _limit(self, threads: int) -> int:
        return max(1, min(threads, self.cap or threads))


def _alive(lease: str) -> bool:
    """Whether the process a lease is named after (`<pid>-<number>`) still runs."""
    try:
        os.kill(int(lease.split("-")[0]), 0)
    except ProcessLookupError:
        return False
    except (ValueError, PermissionError):  # not a lease name, or another user's live process
        return True
    return True
