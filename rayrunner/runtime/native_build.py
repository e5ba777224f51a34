"""rayrunner's C sources, built with the node's C compiler for its CPU at first use and loaded with ctypes.

A source is built (`$CC`, else `cc` or `gcc`; `-march=native`) once per source text and CPU into rayrunner's cache
(`cache_dir() / "kernels"`), so a process that finds it built loads it in milliseconds; a cache shared by nodes of
other CPUs holds one build each. Without a compiler, or where the build fails, `load` gives None (logged) and the
caller keeps PyTorch's operations. A source may include the headers beside it (`-I` its folder): they are part of
what its build is keyed on, so a change to one rebuilds every source of that folder.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from rayrunner.runtime.cache_dir import cache_dir

logger = logging.getLogger(__name__)

# -fopenmp links libgomp, which resolves to the one PyTorch has loaded (same soname): one pool of threads
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC",
         # gcc vectorizes for 256-bit registers on Intel unless told: 512 made RoPE 1.8x faster at 1,860 rows there
         *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))
_BUILD_TIMEOUT_S = 120.0
I64, POINTER = ctypes.c_int64, ctypes.c_void_p  # the C types the kernels' signatures use most
Signatures = dict[str, tuple[list[Any], Any]]  # a function's name: its argument types and its result type


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def load(source: Path, switch_env: str, signatures: Signatures) -> ctypes.CDLL | None:
    """`source` built for this CPU (if not built yet) and loaded, its functions declared by `signatures`; None when
    `switch_env` is "0", without a compiler, or when the build fails."""
    if os.environ.get(switch_env, "1").strip() == "0":
        return None
    path = target(source)
    try:
        if not path.exists():
            cc = compiler()
            if cc is None:
                logger.info("no C compiler ($CC, cc, gcc) to build %s: PyTorch's operations stay", source.name)
                return None
            _build(cc, source, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("building %s failed (%s): PyTorch's operations stay", source.name, exc)
        return None
    for name, (arguments, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = arguments, result
    return lib


def target(source: Path) -> Path:
    """Where `source`, built for this CPU, lies in the cache."""
    headers = [header.read_bytes() for header in sorted(source.parent.glob("*.h"))]
    parts = [source.read_bytes(), *headers, _cpu_flags(), " ".join(FLAGS).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()
    return cache_dir() / "kernels" / f"{source.stem}-{key[:16]}.so"


def _build(cc: str, source: Path, target: Path) -> None:
    """Compile `source` into `target`: under a temporary name, then moved into place, so that replicas starting
    together each build and none loads half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([cc, *FLAGS, "-I", str(source.parent), "-o", str(built), str(source)], check=True,
                       capture_output=True, timeout=_BUILD_TIMEOUT_S)
        os.replace(built, target)
    logger.info("built %s for this CPU: %s", source.name, target)


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what `-march=native` builds for)."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return os.uname().machine.encode()
