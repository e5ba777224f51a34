"""The kind of CPU a benchmark ran on, for the header of every table of figures: rankings flip with it (vLLM's
oneDNN bf16 path runs on AMX and falls back on AVX2-only CPUs; PyTorch has no native bf16 GEMM without avx512_bf16;
int8 paths of other servers use VNNI or AMX int8).
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# bf16 matmul units (vLLM's oneDNN path, PyTorch's native bf16 GEMM) and int8 dot-product units (llama.cpp's and
# mistral.rs's int8 paths), as `grep -ow 'amx_bf16\|amx_int8\|avx512_bf16\|avx512_vnni\|avx2' /proc/cpuinfo | sort -u`
FLAGS = ("amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx2")
CPUINFO = Path("/proc/cpuinfo")


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The CPU's model name, its family and model numbers, and which of `FLAGS` it has, e.g. `AMD EPYC, family 26
    model 2 (avx2 avx512_bf16)`: a VM's model name can hide the generation (AMD family 25 is Zen 3 and 4, 26 Zen 5),
    the numbers do not. `cpuinfo` is the text of /proc/cpuinfo (read here when None; `platform.processor()` and no
    flags where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = CPUINFO.read_text()
        except OSError:
            return f"{platform.processor() or platform.machine()} (flags unknown: no {CPUINFO})"
    names = re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, flags=re.MULTILINE)
    words = set(re.findall(r"\w+", "\n".join(re.findall(r"^flags\s*:.*$", cpuinfo, flags=re.MULTILINE))))
    flags = sorted(flag for flag in FLAGS if flag in words)
    name = names[0].strip() if names else platform.machine()
    return f"{name}{_generation(cpuinfo)} ({' '.join(flags) or 'none of ' + ' '.join(FLAGS)})"


def _generation(cpuinfo: str) -> str:
    """`, family F model M` from the first CPU of `cpuinfo`, or nothing where it does not say."""
    family = re.search(r"^cpu family\s*:\s*(\d+)$", cpuinfo, flags=re.MULTILINE)
    model = re.search(r"^model\s*:\s*(\d+)$", cpuinfo, flags=re.MULTILINE)
    return f", family {family[1]} model {model[1]}" if family and model else ""


def cpu_line() -> str:
    """One header line: the CPU's kind, the CPUs this process may use and the load average now."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return f"CPU: {cpu_kind()}, {cpus} CPUs, load average {os.getloadavg()[0]:.2f}"
