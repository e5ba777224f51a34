"""rayrunner's two engine backends against bare vLLM, on the same SmolLM2 folder, driven by one external harness
(aiperf) over HTTP, alternating the sides over rounds in one run; then switching between two vLLM models by sleep and
wake against cold starts.

Run:  .venv/bin/python bench/bench_engines.py [--rounds 3] [--concurrency 1 16] [--requests N] [--threads N]
                                             [--switches 3] [--compile]
Needs `.venv-vllm` (`bash scripts/install_vllm.sh`, run here when missing) and aiperf's side venv (made on first use).

Three sides, all up for the whole run, measured in turn each round (A B C A B C ...; the others wait idle): bare
vLLM's OpenAI server from that venv, and one rayrunner service holding SmolLM2 twice, on the vllm backend (vLLM's
async engine in the model's replica) and on the transformers backend. Both vLLM sides run the same settings: bf16,
`max_model_len` 2048, a 2 GiB KV cache, and eager (rayrunner's default; `--compile` turns torch.compile on for both:
on this 2-core box a compiled vLLM stalled for seconds at new batch shapes and served 32 tok/s at 16 streams). Every
side gets `--threads` compute threads: vLLM's OpenMP threads bound to the first CPUs (`VLLM_CPU_OMP_THREADS_BIND`,
the rest `VLLM_CPU_NUM_OF_RESERVED_CPU`; the vllm-backend replica inherits both from the cluster's environment),
the transformers backend's `engine.torch_threads`. Measurements, medians and ratios as in bench_vs_vllm.py.

Switching: two vLLM-backend models (eager) in one rayrunner; each switch puts the awake one to sleep and sends the
other a request (`unload` with mode `sleep`, then the request that wakes it: on CPU vLLM's engine starts again inside
the replica, which keeps its process and imports), against the same with mode `stop` (the next request starts a new
replica). Figures: seconds from the unload call to the first reply, median over `--switches`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
from aiperf_harness import Figures, aiperf_command
from bench_vs_vllm import (
    SERVED,
    Side,
    add_arguments,
    alternate,
    header,
    medians,
    print_rounds,
    print_table,
    rayrunner_spec,
    vllm_folder,
    vllm_python,
    vllm_server,
    vllm_thread_env,
)
from cpu_kind import cpu_line
from rayrunner_service import rayrunner_service, smollm2_spec
from side_venv import BENCH_DIR

from rayrunner.models.sources import SMOLLM2, resolve

KV_BYTES = 2 << 30  # bare vLLM gets the same through VLLM_CPU_KVCACHE_SPACE=2


def vllm_spec(model_id: str, compile_: bool) -> dict[str, Any]:
    spec = smollm2_spec(model_id)
    spec["engine"] = {"backend": "vllm", "max_seq_len": 2048, "vllm": {"kv_cache_bytes": KV_BYTES, "compile": compile_}}
    return spec


def serving(args: argparse.Namespace, folder: Path, out_dir: Path) -> dict[str, list[dict[int, Figures]]]:
    """Bare vLLM, rayrunner+vLLM and rayrunner+transformers, all up, measured in turn over the rounds."""
    aiperf_command()
    python = vllm_python()
    os.environ.update(vllm_thread_env(args.threads))  # the cluster starts with it: its vLLM replica's threads
    with ExitStack() as stack:
        bare = stack.enter_context(vllm_server(python, folder, out_dir / "vllm.log", args.threads,
                                               () if args.compile else ("--enforce-eager",)))
        start = time.monotonic()
        ours = stack.enter_context(rayrunner_service([vllm_spec("rr-vllm", compile_=args.compile),
                                                      rayrunner_spec("rr-transformers", args.threads)]))
        print(f"rayrunner ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
        sides = [Side("vLLM bf16", bare, SERVED), Side("rayrunner+vLLM bf16", ours, "rr-vllm"),
                 Side("rayrunner+transformers bf16", ours, "rr-transformers")]
        return alternate(sides, folder, args, out_dir)


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
    add_arguments(parser)
    parser.add_argument("--compile", action="store_true", help="torch.compile on both vLLM sides")
    parser.add_argument("--switches", type=int, default=3, help="switches measured each way (0: none)")
    args = parser.parse_args()
    vllm_thread_env(args.threads)  # a bad --threads fails before anything starts
    out_dir = BENCH_DIR / "runs" / time.strftime("engines-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    print(f"{cpu_line()}; files in {out_dir}")
    with tempfile.TemporaryDirectory(prefix="rayrunner-engines-") as scratch:
        rounds = serving(args, vllm_folder(Path(resolve(SMOLLM2).path), Path(scratch)), out_dir)
    switch = switching(args.switches) if args.switches else {}
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("\n" + header(args, "bf16, CPU"))
    print_table(medians(rounds, args.concurrency), args.concurrency)
    print_rounds(rounds, args.concurrency)
    if switch:
        print(f"\nSwitching between two vLLM models: sleep {switch['sleep']:.1f} s, stop {switch['stop']:.1f} s "
              f"(sleep / stop {switch['sleep'] / switch['stop']:.2f}x)")


if __name__ == "__main__":
    main()
