"""The node's cores divided among busy engines: shares, idling, stale leases, and two processes at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rayrunner.runtime import core_share
from rayrunner.runtime.core_share import CoreShare


def recount(*shares: CoreShare) -> list[int]:
    for share in shares:
        share._checked_at = 0.0  # as if REFRESH_S had passed
    return [share.working() for share in shares]


def test_an_engine_alone_gets_every_core_and_two_busy_ones_split_them(tmp_path: Path) -> None:
    first = CoreShare(cores=5, folder=tmp_path)
    second = CoreShare(cores=5, folder=tmp_path)
    assert first.working() == 5
    recount(second)  # its lease now exists
    assert sorted(recount(first, second)) == [2, 3]  # the remainder to the first in lease order
    first.idle()
    assert recount(second) == [5]  # the idle one's cores go back


def test_more_busy_engines_than_cores_keep_one_thread_each(tmp_path: Path) -> None:
    shares = [CoreShare(cores=2, folder=tmp_path) for _ in range(3)]
    recount(*shares)
    assert recount(*shares) == [1, 1, 1]


def test_the_cap_bounds_the_share(tmp_path: Path) -> None:
    assert CoreShare(cap=3, cores=8, folder=tmp_path).working() == 3
    alone = CoreShare(cap=core_share.node_cores(), folder=tmp_path / "alone")  # set by hand: may take the serving core
    assert alone.working() == core_share.node_cores()


def test_stale_leases_count_as_idle_and_dead_engines_leases_are_swept(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, old = tmp_path / f"{os.getpid()}-1", tmp_path / f"{os.getpid()}-2"
    dead = tmp_path / f"{gone.stdout.strip()}-3"
    for lease, age in ((stale, core_share.STALE_S + 1), (old, core_share.SWEEP_S + 1), (dead, 0)):
        lease.touch()
        os.utime(lease, (time.time() - age, time.time() - age))
    assert CoreShare(cores=4, folder=tmp_path).working() == 4
    assert stale.exists() and not old.exists() and not dead.exists()


SHARER = """
import sys, time
from pathlib import Path
from rayrunner.runtime.core_share import CoreShare
share = CoreShare(cores=int(sys.argv[2]), folder=Path(sys.argv[1]))
share.working()
print("started", flush=True)
sys.stdin.readline()  # both are busy now
deadline = time.time() + 0.5
while time.time() < deadline:
    threads = share.working()
    time.sleep(0.01)
print(threads, flush=True)
share.idle()
"""


def test_two_engines_in_two_processes_never_take_more_than_the_cores(tmp_path: Path) -> None:
    cores = max(2, core_share.node_cores())
    engines = [subprocess.Popen([sys.executable, "-c", SHARER, str(tmp_path), str(cores)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for engine in engines:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "started"
    for engine in engines:
        assert engine.stdin is not None
        engine.stdin.write("go\n")
        engine.stdin.flush()
    threads = [int(engine.communicate(timeout=30)[0].strip()) for engine in engines]
    assert sum(threads) == cores and min(threads) >= 1


def test_the_engines_leave_a_core_to_the_serving_path_on_larger_nodes_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(core_share.SERVING_CORES_ENV, raising=False)
    assert [core_share.serving_cores(cores) for cores in (1, 2, 3, 64)] == [0, 0, 1, 1]
    monkeypatch.setattr(core_share, "node_cores", lambda: 2)
    assert core_share.engine_cores() == 2 and CoreShare(folder=tmp_path).working() == 2
    monkeypatch.setattr(core_share, "node_cores", lambda: 8)
    assert core_share.engine_cores() == 7 and CoreShare(folder=tmp_path / "eight").working() == 7


def test_the_serving_cores_setting_overrides_the_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(core_share.SERVING_CORES_ENV, "1")
    monkeypatch.setattr(core_share, "node_cores", lambda: 2)
    assert core_share.engine_cores() == 1
    monkeypatch.setenv(core_share.SERVING_CORES_ENV, "2")
    assert core_share.engine_cores() == 1  # at least one
    monkeypatch.setenv(core_share.SERVING_CORES_ENV, "all")
    with pytest.raises(ValueError, match="RAYRUNNER_SERVING_CORES"):
        core_share.engine_cores()


def test_a_deleted_lease_folder_is_made_again(tmp_path: Path) -> None:
    """A clean-up of /dev/shm or /tmp must not stop an engine: its next refresh makes the folder again."""
    import shutil

    folder = tmp_path / "cores"
    engine = CoreShare(cores=2, folder=folder)
    assert engine.working() == 2
    shutil.rmtree(folder)
    assert recount(engine) == [2] and engine.lease.exists()
