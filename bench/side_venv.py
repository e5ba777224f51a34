"""Side venvs for the programs a benchmark compares rayrunner with or drives it by (vLLM, aiperf): each made once under
`.bench/<name>` at the repository root (gitignored), so they never touch rayrunner's own venv and later runs reuse them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1] / ".bench"


def side_python(name: str, install: list[str], remove: tuple[str, ...] = ()) -> Path:
    """The python of venv `name`, with `install` installed by pip and then `remove` uninstalled. A venv whose marker
    file records the same request is reused; otherwise it is (re)made, with pip's output in `.bench/<name>.log`."""
    venv = BENCH_DIR / name
    python = venv / "bin" / "python"
    marker = venv / ".bench-installed"
    wanted = " ".join(install) + (" -" + " -".join(remove) if remove else "")
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    BENCH_DIR.mkdir(exist_ok=True)
    log = BENCH_DIR / f"{name}.log"
    print(f"installing {' '.join(install)} into {venv} (log: {log}); this takes minutes once", file=sys.stderr)
    with log.open("w") as out:
        steps = [[sys.executable, "-m", "venv", str(venv)], [str(python), "-m", "pip", "install", *install]]
        if remove:
            steps.append([str(python), "-m", "pip", "uninstall", "-y", *remove])
        for step in steps:
            if subprocess.run(step, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise RuntimeError(f"`{' '.join(step)}` failed: see {log}")
    marker.write_text(wanted)
    return python
