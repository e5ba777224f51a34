"""What a second replica costs and how Serve spreads requests over two: SmolLM2 once with `num_replicas: 1` and once
with 2, in one rayrunner, over HTTP.

Run:  .venv/bin/python bench/bench_replicas.py [--requests 60] [--concurrent 32]

Overhead: `--requests` sequential one-token chats to each model, p50 and p90 latency, and the ratio two / one (the
routing between replicas is the only difference). Spread: `--concurrent` chats at once to the two-replica model;
each replica's share from its own count (`requests_served` of its info, through Serve's `broadcast`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time

import httpx
from cpu_kind import cpu_line
from ray import serve
from rayrunner_service import rayrunner_service, smollm2_spec

from rayrunner.replica.model_server import DEPLOYMENT


def latencies(http: httpx.Client, model: str, count: int) -> list[float]:
    out = []
    for i in range(count):
        start = time.perf_counter()
        reply = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 1})
        assert reply.status_code == 200, reply.text
        out.append(time.perf_counter() - start)
    return out


def served(app: str) -> list[int]:
    infos = serve.get_deployment_handle(DEPLOYMENT, app_name=app).broadcast("info").results(timeout_s=60)
    return sorted(int(info["requests_served"]) for info in infos)


def spread(http: httpx.Client, model: str, count: int) -> list[int]:
    """How many of `count` concurrent chats each replica took."""
    before = served(model)

    def one(i: int) -> int:
        return http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 16}).status_code

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        codes = list(pool.map(one, range(count)))
    assert all(code == 200 for code in codes), codes
    return [after - was for after, was in zip(served(model), before, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrent", type=int, default=32)
    args = parser.parse_args()
    one, two = smollm2_spec("one"), smollm2_spec("two")
    two["engine"] = {"num_replicas": 2}
    with rayrunner_service([one, two]) as base, httpx.Client(base_url=base, timeout=600) as http:
        latencies(http, "one", 3), latencies(http, "two", 6)  # warm both paths
        figures = {}
        for model in ("one", "two"):
            times = latencies(http, model, args.requests)
            figures[model] = (statistics.median(times), statistics.quantiles(times, n=10)[-1])
            print(f"{model}: p50 {figures[model][0] * 1e3:.1f} ms, p90 {figures[model][1] * 1e3:.1f} ms",
                  file=sys.stderr)
        shares = spread(http, "two", args.concurrent)
    print(f"\n{cpu_line()}\nSmolLM2 bf16, one-token chats over HTTP, {args.requests} sequential each; one run")
    print("| replicas | p50 (ms) | p90 (ms) |\n|---|---|---|")
    for model, (p50, p90) in figures.items():
        print(f"| {model} | {p50 * 1e3:.1f} | {p90 * 1e3:.1f} |")
    print(f"\np50 two / one: {figures['two'][0] / figures['one'][0]:.2f}x; {args.concurrent} concurrent chats over "
          f"two replicas: {shares} ({min(shares) / args.concurrent:.0%} to the less used)")


if __name__ == "__main__":
    main()
