"""Serving overhead of rayrunner on the builtin SmolLM2 (smollm2-135m-instruct), measured side by side in one run.

1. Single-stream decode: tok/s of `POST /v1/chat/completions` through the router (greedy, `max_tokens` N, wall time
   and `usage.completion_tokens`) vs tok/s of the same engine (`TextEngine`, the replica's spec and torch threads)
   in this process (same chat, greedy, N tokens). The two sides alternate request by request (HTTP, then in
   process), so they never run at the same time and machine noise hits both alike. Both walls include prefill.
2. Router hop: latency of a 1-token request via HTTP -> router -> model, vs HTTP straight into a second replica of
   the same model (`DirectServer`: ModelServer plus an HTTP `__call__`, route `/direct`), alternating A/B.

Run:  .venv/bin/python bench/bench_serving.py [--reps 5] [--max-tokens 64] [--latency-requests 50] [--threads 2]
It starts its own local Ray cluster (Serve and dashboard on free ports in 30000-32000) and shuts it down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
from bench_cluster import start_cluster
from cpu_kind import cpu_line
from ray import serve

from rayrunner.models.sources import SMOLLM2
from rayrunner.replica.model_server import ModelServer
from rayrunner.router.app import build_router_app

MODEL_ID = "smollm2"
# The router's access log is off (as the brief's serve.start asks). The registry deploys the model app with Serve's
# default logging (access log on, not configurable), so DirectServer keeps that default too: the model-side cost is
# then identical on both paths and the difference is the router alone.
QUIET = {"enable_access_log": False}


class DirectServer(ModelServer):
    """The model replica itself answering HTTP: the baseline with no router in between."""

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse(await self.chat(await request.json()))


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"torch_threads": args.threads, "num_cpus": 0.5}


def deploy_router(args: argparse.Namespace, http: httpx.Client, state_dir: str) -> None:
    spec = {"model_id": MODEL_ID, "which": {"type": "plain", "model_id": SMOLLM2}, "engine": engine_settings(args)}
    config = {"models": [{"spec": spec, "load": True}], "state_path": str(Path(state_dir) / "registry.json")}
    serve.run(build_router_app(config), name="rayrunner", route_prefix="/", logging_config=QUIET)
    assert http.get("/health").json() == {"status": "ok"}
    deadline = time.monotonic() + 600
    while http.post("/v1/models/status", json={"model_id": MODEL_ID}).json().get("status") != "loaded":
        if time.monotonic() > deadline:
            raise RuntimeError("the model did not load within 600 s")
        time.sleep(0.5)


def deploy_direct(args: argparse.Namespace) -> None:
    spec = {"model_id": MODEL_ID, "which": {"type": "plain", "model_id": SMOLLM2}, "engine": engine_settings(args)}
    app = serve.deployment(DirectServer).options(
        name="Direct", num_replicas=1, max_ongoing_requests=64, ray_actor_options={"num_cpus": 0.5}
    ).bind(spec)
    serve.run(app, name="direct", route_prefix="/direct")


def chat_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0}


def timed_post(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    response = http.post(path, json=body)
    elapsed = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {response.status_code} {response.text[:300]}")
    return elapsed, response.json()


class InProcess:
    """The same engine (rayrunner's `TextEngine`, the replica's spec and threads) in this process, on its own event
    loop: the same prompt, greedy, the same number of tokens."""

    def __init__(self, args: argparse.Namespace) -> None:
        from rayrunner.engines.transformers.text import TextEngine
        from rayrunner.models.spec import build_spec

        self.engine = TextEngine(build_spec(MODEL_ID, {"type": "plain", "model_id": SMOLLM2},
                                            engine=engine_settings(args)))
        self.prompt = args.prompt
        self.loop = asyncio.new_event_loop()

    def run(self, tokens: int) -> tuple[float, int, float]:
        """The wall seconds, the completion tokens and the engine's own decode tok/s (as `usage` reports it)."""
        return self.loop.run_until_complete(self._chat(tokens))

    async def _chat(self, tokens: int) -> tuple[float, int, float]:
        from rayrunner.openai.sampling_params import SamplingParams
        from rayrunner.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(messages=[{"role": "user", "content": self.prompt}])
        start, last = time.perf_counter(), None
        async for event in self.engine.chat(request, SamplingParams(max_tokens=tokens, ignore_eos=True)):
            last = event
        wall = time.perf_counter() - start
        assert last is not None
        return wall, last.completion_tokens, last.completion_tokens / last.completion_time_s

    def close(self) -> None:
        self.engine.close()
        self.loop.close()


def pct(values: list[float], q: int) -> float:
    """q-th percentile (inclusive method) of `values`."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def bench_decode(args: argparse.Namespace, http: httpx.Client) -> dict[str, Any]:
    body = chat_body(args.prompt, args.max_tokens)
    timed_post(http, "/v1/chat/completions", body)  # warm-up
    local = InProcess(args)
    try:
        local.run(args.max_tokens)  # warm-up
        http_rate, http_wall, server_rate, local_rate, local_wall, local_decode = [], [], [], [], [], []
        tokens = set()
        for _ in range(args.reps):
            wall, result = timed_post(http, "/v1/chat/completions", body)
            usage = result["usage"]
            tokens.add(usage["completion_tokens"])
            http_wall.append(wall)
            http_rate.append(usage["completion_tokens"] / wall)
            server_rate.append(usage["avg_compl_tok_per_sec"])
            wall, n, decode_rate = local.run(args.max_tokens)
            tokens.add(n)
            local_wall.append(wall)
            local_rate.append(n / wall)
            local_decode.append(decode_rate)
    finally:
        local.close()
    if tokens != {args.max_tokens}:
        print(f"WARNING: completions had {sorted(tokens)} tokens, not {args.max_tokens}")
    med = statistics.median
    pairs = [a / b for a, b in zip(http_rate, local_rate, strict=True)]
    return {"http": med(http_rate), "http_wall": med(http_wall), "server": med(server_rate),
            "local": med(local_rate), "local_wall": med(local_wall), "local_decode": med(local_decode),
            "pair_ratio": med(pairs)}


def bench_hop(args: argparse.Namespace, http: httpx.Client) -> dict[str, list[float]]:
    body = chat_body("Hi", 1)
    paths = {"router": "/v1/chat/completions", "direct": "/direct"}
    for _ in range(3):  # warm-up both paths
        for path in paths.values():
            timed_post(http, path, body)
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(args.latency_requests):
        order = list(paths.items()) if i % 2 == 0 else list(reversed(paths.items()))
        for name, path in order:
            wall, result = timed_post(http, path, body)
            assert result["usage"]["completion_tokens"] == 1, result["usage"]
            samples[name].append(wall * 1000)
    # For scale: one actor round trip here. The router no longer makes one per request (it routes from a long-polled
    # copy of the registry's table), but this is the unit a hop costs at least.
    from rayrunner.registry.actor import NAMESPACE, REGISTRY_NAME

    registry = ray.get_actor(REGISTRY_NAME, namespace=NAMESPACE)
    samples["resolve"] = []
    for _ in range(args.latency_requests):
        start = time.perf_counter()
        ray.get(registry.resolve.remote(MODEL_ID))
        samples["resolve"].append((time.perf_counter() - start) * 1000)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="decode repetitions per side (median reported)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens generated per decode request")
    parser.add_argument("--latency-requests", type=int, default=50, help="1-token requests per path")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (replica + driver)")
    parser.add_argument("--prompt", default="Write a long story about a dragon.")
    parser.add_argument("--http-port", type=int, default=0, help="Serve HTTP port (default: free, 30000-32000)")
    parser.add_argument("--dashboard-port", type=int, default=0, help="dashboard port (default: free)")
    args = parser.parse_args()

    print(f"load average at start: {os.getloadavg()[0]:.2f} (machine has {os.cpu_count()} CPUs)")
    base = start_cluster(args.dashboard_port, args.http_port)
    try:
        with tempfile.TemporaryDirectory(prefix="rayrunner-bench-") as state_dir, \
                httpx.Client(base_url=base, timeout=600) as http:
            t0 = time.perf_counter()
            deploy_router(args, http, state_dir)
            print(f"router + model ready in {time.perf_counter() - t0:.1f} s")
            decode = bench_decode(args, http)
            deploy_direct(args)
            hop = bench_hop(args, http)
    finally:
        serve.shutdown()
        ray.shutdown()

    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"\n{cpu_line()}")
    print(f"\nSingle-stream decode, {SMOLLM2}, bf16, greedy, {args.max_tokens} tokens, {args.threads} torch threads, "
          f"median of {args.reps} (alternating)")
    print(f"{'path':<40}{'tok/s':>10}{'wall s':>10}")
    print(f"{'HTTP -> router -> model (client wall)':<40}{decode['http']:>10.2f}{decode['http_wall']:>10.3f}")
    print(f"{'  (replica decode-only, usage)':<40}{decode['server']:>10.2f}{'':>10}")
    print(f"{'the same engine in process (wall)':<40}{decode['local']:>10.2f}{decode['local_wall']:>10.3f}")
    print(f"{'  (engine decode-only, usage)':<40}{decode['local_decode']:>10.2f}{'':>10}")
    ratio = decode["http"] / decode["local"]
    print(f"{'ratio HTTP / in-process (of medians)':<40}{ratio:>10.3f}")
    print(f"{'  median of per-pair ratios':<40}{decode['pair_ratio']:>10.3f}")

    print(f"\n1-token request latency (max_tokens=1), {args.latency_requests} requests per path, interleaved A/B")
    print(f"{'path':<40}{'p50 ms':>10}{'p90 ms':>10}{'mean ms':>10}")
    for name, label in (("router", "HTTP -> router -> model"), ("direct", "HTTP -> model (DirectServer)")):
        values = hop[name]
        print(f"{label:<40}{pct(values, 50):>10.2f}{pct(values, 90):>10.2f}{statistics.mean(values):>10.2f}")
    diffs = [a - b for a, b in zip(hop["router"], hop["direct"], strict=True)]
    router_hop = pct(hop["router"], 50) - pct(hop["direct"], 50)
    print(f"{'router hop = p50(router) - p50(direct)':<40}{router_hop:>10.2f}")
    print(f"{'  median of paired differences':<40}{statistics.median(diffs):>10.2f}")
    print(f"{'  one registry actor call, p50 (scale)':<40}{pct(hop['resolve'], 50):>10.2f}")
    print(f"\nSUMMARY: decode HTTP/in-process = {ratio:.3f} ({decode['http']:.1f} vs {decode['local']:.1f} tok/s); "
          f"router hop p50 = {router_hop:.2f} ms (target <= 3 ms: {'met' if router_hop <= 3 else 'NOT met'})")


if __name__ == "__main__":
    main()
