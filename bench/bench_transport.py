"""Serve's hops as gRPC channels against Ray actor calls (`rayrunner/runtime/transport.py`), over real HTTP on the
builtin SmolLM2 (bf16, CPU), in alternating pairs of fresh clusters so that machine noise hits both sides alike.

Each side runs in a subprocess of its own (the switch `RAYRUNNER_SERVE_GRPC` is read by the cluster's processes
when they start): it starts a cluster, deploys the model as `bench_scheduling` does, lets the warm spare worker
finish importing (`--settle`), then measures one stream (median of 3) and 16 concurrent streams (best of 2),
`--max-tokens` each. Reported: every pair, and the medians of each side.

Run:  .venv/bin/python bench/bench_transport.py [--pairs 3] [--max-tokens 64] [--settle 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from cpu_kind import cpu_line

SIDES = {"grpc": "1", "actor": "0"}


def measure(max_tokens: int, settle_s: float) -> dict[str, float]:
    """One side, in this process: a fresh cluster, the model deployed, one stream and 16 streams timed."""
    import httpx
    import ray
    from bench_cluster import start_cluster
    from bench_scheduling import PROMPTS, aggregate, deploy, stream
    from ray import serve

    async def run(base: str) -> dict[str, float]:
        async with httpx.AsyncClient(base_url=base, timeout=600) as client:
            await stream(client, "Hi", 4)  # warm-up
            ones = [await stream(client, PROMPTS[0], max_tokens) for _ in range(3)]
            sixteen = [await aggregate(client, max_tokens, sampled=False) for _ in range(2)]
        return {"one": statistics.median(tokens / wall for wall, tokens in ones), "sixteen": max(sixteen)}

    base = start_cluster()
    try:
        with tempfile.TemporaryDirectory(prefix="rayrunner-bench-") as state_dir, \
                httpx.Client(base_url=base, timeout=600) as http:
            deploy(http, state_dir, threads=2)
            time.sleep(settle_s)
            return asyncio.run(run(base))
    finally:
        serve.shutdown()
        ray.shutdown()


def side(name: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, "RAYRUNNER_SERVE_GRPC": SIDES[name], "RAY_SERVE_PROXY_USE_GRPC": SIDES[name]}
    command = [sys.executable, __file__, "--side", name, "--max-tokens", str(args.max_tokens),
               "--settle", str(args.settle)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--settle", type=float, default=8.0, help="seconds between the deploy and the first request")
    parser.add_argument("--side", choices=sorted(SIDES), help=argparse.SUPPRESS)  # one side, in a subprocess
    args = parser.parse_args()
    if args.side:
        print(json.dumps(measure(args.max_tokens, args.settle)))
        return
    results: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
    print(f"{cpu_line()}")
    print(f"SmolLM2 bf16, CPU, {args.max_tokens} tokens a stream; tok/s (one stream: median of 3; 16: best of 2)")
    for pair in range(1, args.pairs + 1):
        for name in SIDES:
            results[name].append(side(name, args))
        print(f"pair {pair}: " + "; ".join(f"{name} one {r[-1]['one']:.1f} sixteen {r[-1]['sixteen']:.1f}"
                                           for name, r in results.items()), flush=True)
    for name, runs in results.items():
        one, sixteen = (statistics.median(r[key] for r in runs) for key in ("one", "sixteen"))
        print(f"{name:6} median: one stream {one:.1f}, 16 streams {sixteen:.1f} ({sixteen / one:.2f}x)")


if __name__ == "__main__":
    main()
