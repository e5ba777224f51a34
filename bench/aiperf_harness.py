"""aiperf (NVIDIA's LLM benchmark client, from PyPI, in a side venv) as the one external harness that drives every
server a benchmark compares: streamed chats, the same synthetic prompts on every server (`Load.seed`: a benchmark
gives each round and concurrency its own, so no server's prefix cache finds a prompt it served in an earlier
measurement), a fixed output length (`max_completion_tokens` with `ignore_eos` and `min_tokens`), greedy.

aiperf is paced with `--request-rate 200 --arrival-pattern constant` on top of `--concurrency`: in plain concurrency
mode its timing process busy-loops a core, which on a 2-core box takes half the machine from the server. Output
token counts are the server's own (`usage`, `--use-server-token-count`), so a server that stops early shows it.
It loads the tokenizer from a local folder, which works only with `HF_HUB_OFFLINE` unset.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from side_venv import side_python

AIPERF = ["aiperf==0.13.0"]
_TO_SECONDS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


@dataclass(frozen=True)
class Load:
    """What one aiperf run sends."""

    concurrency: int
    requests: int
    prompt_tokens: int = 94
    output_tokens: int = 64
    seed: int = 0  # of aiperf's synthetic prompts


@dataclass(frozen=True)
class Figures:
    """One aiperf run's results, in seconds and tokens."""

    output_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    output_tokens: float  # mean completion tokens per request, as the server counted them
    prompt_tokens: float  # mean prompt tokens per request (chat template included), as the server counted them
    requests: int
    errors: int


def median_figures(runs: list[Figures]) -> Figures:
    """Each figure's median over `runs` (rounds of one side), with their requests and errors summed."""
    medians = {f.name: statistics.median(getattr(run, f.name) for run in runs) for f in fields(Figures)}
    return Figures(**{**medians, "requests": sum(run.requests for run in runs),
                      "errors": sum(run.errors for run in runs)})


def aiperf_command() -> Path:
    """aiperf's console script in its side venv (installed on first use)."""
    return side_python("aiperf", AIPERF).parent / "aiperf"


def profile(aiperf: Path, base_url: str, model: str, tokenizer: str, load: Load, out_dir: Path) -> Figures:
    """Run aiperf once against `base_url` (warm-up: one request per stream, not counted); its files go to
    `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [
        str(aiperf), "profile", "--model", model, "--url", base_url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", tokenizer, "--random-seed", str(load.seed),
        "--isl", str(load.prompt_tokens), "--synthetic-input-tokens-stddev", "0",
        "--osl", str(load.output_tokens), "--output-tokens-stddev", "0",
        "--extra-inputs", "temperature:0", "--extra-inputs", "ignore_eos:true",
        "--extra-inputs", f"min_tokens:{load.output_tokens}", "--use-server-token-count",
        "--concurrency", str(load.concurrency), "--request-rate", "200", "--arrival-pattern", "constant",
        "--request-count", str(load.requests), "--warmup-request-count", str(load.concurrency),
        "--workers-max", "1", "--record-processors", "1", "--ui-type", "none", "--no-server-metrics",
        "--no-gpu-telemetry", "--no-auto-plot", "--export-level", "summary", "--output-artifact-dir", str(out_dir),
    ]
    env = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    with (out_dir / "aiperf.log").open("w") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"aiperf failed (code {done.returncode}): see {out_dir / 'aiperf.log'}")
    return read_figures(out_dir / "profile_export_aiperf.json")


def read_figures(path: Path) -> Figures:
    """The figures a benchmark reports, from aiperf's summary JSON."""
    data: dict[str, Any] = json.loads(path.read_text())

    def stat(tag: str, name: str, seconds: bool = False) -> float:
        metric = data.get(tag) or {}
        value = metric.get(name)
        if value is None:
            return float("nan")
        return float(value) * (_TO_SECONDS[metric.get("unit", "s")] if seconds else 1.0)

    return Figures(
        output_tok_s=stat("output_token_throughput", "avg"),
        ttft_p50_s=stat("time_to_first_token", "p50", seconds=True),
        ttft_p99_s=stat("time_to_first_token", "p99", seconds=True),
        itl_p50_s=stat("inter_token_latency", "p50", seconds=True),
        output_tokens=stat("output_sequence_length", "avg"),
        prompt_tokens=stat("usage_prompt_tokens", "avg"),
        requests=int(stat("request_count", "avg")),
        errors=int(stat("error_request_count", "avg") if data.get("error_request_count") else 0),
    )
