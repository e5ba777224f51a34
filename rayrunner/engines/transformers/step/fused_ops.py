"""Fused bf16 operations for the fast decode step on CPU, compiled from `fused_ops.c` on first use.

Between its matmuls a decode step of a small model is many tiny PyTorch operations, each a few microseconds of
dispatch whatever its size: a residual add and an RMSNorm alone are nine of them, twice a layer. vLLM's CPU backend
fuses these in C++ kernels of its own; PyTorch has none (its `F.rms_norm` is the same operations composed, and
inductor's compiled code costs more per call than it saves at a few rows: docs/performance.md, "Fused operations").
`add_rms_norm` does the add and the norm in one call, rounding every intermediate to bf16 where PyTorch's operations
do, so its output is transformers' to within the order of one float32 sum.

The C file is built with the system's C compiler (`$CC`, else `cc` or `gcc`) for this CPU (`-march=native`), once
per source and CPU, into rayrunner's cache (`cache_dir() / "kernels"`); a process that finds it built
loads it in milliseconds. Without a compiler, or where the build fails, `library()` is None and the step keeps
PyTorch's operations (logged once). `RAYRUNNER_FUSED_OPS=0` turns the fused path off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from rayrunner.runtime.cache_dir import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
SWITCH_ENV = "RAYRUNNER_FUSED_OPS"
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-shared", "-fPIC")
_BUILD_TIMEOUT_S = 120.0


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else `cc` or `gcc` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The fused operations, built if needed and loaded; None when switched off or not buildable here."""
    if os.environ.get(SWITCH_ENV, "1").strip() == "0":
        return None
    path = _target()
    try:
        if not path.exists():
            cc = compiler()
            if cc is None:
                logger.info("no C compiler ($CC, cc, gcc): the fast decode step keeps PyTorch's operations")
                return None
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("building %s failed (%s): the fast decode step keeps PyTorch's operations", SOURCE.name, exc)
        return None
    i64, pointer = ctypes.c_int64, ctypes.c_void_p
    lib.add_rms_norm.argtypes = [pointer, pointer, pointer, pointer, i64, i64, ctypes.c_float]
    lib.add_rms_norm.restype = None
    return lib


def _target() -> Path:
    """Where the library of this source, built for this CPU, lies in the cache."""
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), _cpu_flags(), " ".join(FLAGS).encode()])).hexdigest()
    return cache_dir() / "kernels" / f"fused_ops-{key[:16]}.so"


def _build(cc: str, target: Path) -> None:
    """Compile the source into `target`: under a temporary name, then moved into place, so that replicas starting
    together each build and none loads half a file."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        subprocess.run([cc, *FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True,
                       timeout=_BUILD_TIMEOUT_S)
        os.replace(built, target)
    logger.info("built %s for this CPU: %s", SOURCE.name, target)


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what `-march=native` builds for), so that a cache shared by nodes of other CPUs
    holds one build each."""
    try:
        with open("/proc/cpuinfo", "rb") as info:
            return next((line for line in info if line.startswith(b"flags")), b"")
    except OSError:
        return os.uname().machine.encode()


def applies(hidden: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes `hidden`: bf16 on the CPU, with the library built."""
    return hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu" and library() is not None


def add_rms_norm(hidden: torch.Tensor, addend: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`hidden += addend` (in place; none when `addend` is None), then the RMS norm of `hidden` [rows, width] times
    `weight` [width], as transformers' `LlamaRMSNorm` computes it in bf16; a new tensor. Takes what `applies` says."""
    lib = library()
    assert lib is not None and hidden.is_contiguous() and hidden.dim() == 2
    rows, width = hidden.shape
    if addend is not None:
        addend = addend.contiguous()
        if addend.shape != hidden.shape or addend.dtype != hidden.dtype:
            raise ValueError(f"addend {tuple(addend.shape)} {addend.dtype} does not match {tuple(hidden.shape)}")
    weight = weight.contiguous()
    if weight.shape != (width,) or weight.dtype != hidden.dtype:
        raise ValueError(f"norm weight {tuple(weight.shape)} {weight.dtype} does not fit rows of {width}")
    out = torch.empty_like(hidden)
    lib.add_rms_norm(hidden.data_ptr(), None if addend is None else addend.data_ptr(), weight.data_ptr(),
                     out.data_ptr(), rows, width, eps)
    return out
