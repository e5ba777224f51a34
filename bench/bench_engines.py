"""rayrunner's two engine backends against bare vLLM, on the same SmolLM2 folder, driven by one external harness
(aiperf) over HTTP in one run; then switching between two vLLM models by sleep and wake against cold starts.

Run:  .venv/bin/python bench/bench_engines.py [--concurrency 1 16] [--requests N] [--switches 3] [--compile]
Needs `.venv-vllm` (`bash scripts/install_vllm.sh`, run here when missing) and aiperf's side venv (made on first use).

One side serves at a time (the box has 2 cores): rayrunner with SmolLM2 on the transformers backend, then rayrunner
with SmolLM2 on the vllm backend (vLLM's async engine in the model's replica), then vLLM's own OpenAI server from the
same venv. Both vLLM sides run the same settings: bf16, `max_model_len` 2048, a 2 GiB KV cache, and eager (rayrunner's
default; `--compile` turns torch.compile on for both: on this 2-core box a compiled vLLM stalled for seconds at new
batch shapes and served 32 tok/s at 16 streams). Measurements as in bench_vs_vllm.py: `--requests`
streamed greedy chats at each concurrency after a warm-up, fixed prompt and output lengths (`ignore_eos`).

Switching: two vLLM-backend models (eager) in one rayrunner; each switch puts the awake one to sleep and sends the
other a request (`unload` with mode `sleep`, then the request that wakes it: on CPU vLLM's engine starts again inside
the replica, which keeps its process and imports), against the same with mode `stop` (the next request starts a new
replica). Figures: seconds from the unload call to the first reply, median over `--switches`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from aiperf_harness import Figures, aiperf_command
from bench_vs_vllm import SERVED, measure, print_table, vllm_folder, vllm_server
from rayrunner_service import rayrunner_service, smollm2_spec
from side_venv import BENCH_DIR

from rayrunner.deployments.vllm_runtime import CHECKOUT_VENV
from rayrunner.models.sources import SMOLLM2, resolve

ROOT = Path(__file__).resolve().parents[1]
KV_BYTES = 2 << 30  # bare vLLM gets the same through VLLM_CPU_KVCACHE_SPACE=2


def vllm_python() -> Path:
    """The checkout's vLLM venv (installed now if it is not ready): rayrunner's vLLM replicas and bare vLLM alike."""
    subprocess.run(["bash", str(ROOT / "scripts" / "install_vllm.sh")], check=True)  # returns at once when done
    return CHECKOUT_VENV / "bin" / "python"


def vllm_spec(model_id: str, compile_: bool) -> dict[str, Any]:
    spec = smollm2_spec(model_id)
    spec["engine"] = {"backend": "vllm", "max_seq_len": 2048, "vllm": {"kv_cache_bytes": KV_BYTES, "compile": compile_}}
    return spec


def serving(args: argparse.Namespace, folder: Path, out_dir: Path) -> dict[str, dict[int, Figures]]:
    """Each side in turn: rayrunner+transformers, rayrunner+vLLM, bare vLLM."""
    aiperf_command()
    python = vllm_python()
    sides: dict[str, dict[int, Figures]] = {}
    with vllm_server(python, folder, out_dir / "vllm.log", () if args.compile else ("--enforce-eager",)) as base:
        sides["vLLM"] = measure(base, SERVED, folder, args, out_dir / "vllm")
    for name, spec in (("rayrunner+vLLM", vllm_spec(SERVED, compile_=args.compile)),
                       ("rayrunner+transformers", smollm2_spec(SERVED))):
        start = time.monotonic()
        with rayrunner_service([spec]) as base:
            print(f"{name} ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
            sides[name] = measure(base, SERVED, folder, args, out_dir / name)
    return sides


def switching(switches: int) -> dict[str, float]:
    """Median seconds from unloading the awake model to the other's first reply, by sleep and by stop."""
    ids = ["vllm-a", "vllm-b"]
    figures: dict[str, float] = {}
    with rayrunner_service([vllm_spec(i, compile_=False) for i in ids]) as base, \
            httpx.Client(base_url=base, timeout=900) as http:
        for mode in ("sleep", "stop"):
            times = []
            for turn in range(2 * switches):
                awake, other = ids[turn % 2], ids[(turn + 1) % 2]
                start = time.perf_counter()
                response = http.post("/v1/models/unload", json={"model_id": awake, "mode": mode})
                assert response.status_code == 200, response.text
                reply = http.post("/v1/chat/completions", json={
                    "model": other, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
                assert reply.status_code == 200, reply.text
                if turn:  # the first turn only puts the models in step (both were awake)
                    times.append(time.perf_counter() - start)
            figures[mode] = statistics.median(times)
            print(f"switch by {mode}: {[round(t, 1) for t in times]}", file=sys.stderr)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int,
                        help="requests per measurement, at least one per stream (default: 4 per stream, at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=94)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="torch.compile on both vLLM sides")
    parser.add_argument("--switches", type=int, default=3, help="switches measured each way (0: none)")
    args = parser.parse_args()
    out_dir = BENCH_DIR / "runs" / time.strftime("engines-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); files in {out_dir}")
    with tempfile.TemporaryDirectory(prefix="rayrunner-engines-") as scratch:
        sides = serving(args, vllm_folder(Path(resolve(SMOLLM2).path), Path(scratch)), out_dir)
    switch = switching(args.switches) if args.switches else {}
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"\nSmolLM2-135M-Instruct bf16, CPU, streamed chat via aiperf, {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens} output tokens asked (ignore_eos), greedy; one run\n")
    print_table(sides, args.concurrency)
    if switch:
        print(f"\nSwitching between two vLLM models: sleep {switch['sleep']:.1f} s, stop {switch['stop']:.1f} s "
              f"(sleep / stop {switch['sleep'] / switch['stop']:.2f}x)")


if __name__ == "__main__":
    main()
