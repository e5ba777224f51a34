"""Multi-node placement and failover on a simulated cluster (head + two worker nodes on this machine).

The scenario (tests/multinode_scenario.py) starts its own Ray cluster, which cannot share this session's, so it
runs in a child process; its output is shown when it fails. About 2-3 minutes on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SCENARIO = Path(__file__).resolve().parents[1] / "multinode_scenario.py"
TIMEOUT_S = 480


def test_models_placed_by_resources_refused_when_unplaceable_and_moved_off_a_dead_node(
    tiny_llama_dir: str, tmp_path: Path
) -> None:
    ray_tmp = tempfile.mkdtemp(prefix="rrmn", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    env.pop("RAY_ADDRESS", None)
    child = subprocess.Popen(
        [sys.executable, str(SCENARIO), tiny_llama_dir, str(tmp_path)], cwd=SCENARIO.parents[1], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the scenario and the Ray processes it started with it
        output, _ = child.communicate()
        output += f"\n(killed after {TIMEOUT_S} s; Ray's logs are kept in {ray_tmp})"
    if child.returncode == 0:
        shutil.rmtree(ray_tmp, ignore_errors=True)  # kept on failure: the scenario's last line says where
    report = "\n".join(line for line in output.splitlines() if line.startswith(("[", "FAILED", "Traceback", " ")))
    assert child.returncode == 0, f"multi-node scenario failed (exit {child.returncode}):\n{report or output}"
