"""The step scheduler seen from outside, on the builtin SmolLM2 (bf16, CPU) over real HTTP, side by side in one run.

Measured (each a median over `--reps` rounds; within a round the cases run one after another, so noise on this shared
machine hits them alike):
1. Concurrency: 16 concurrent streamed chats (greedy, `--max-tokens` each) as aggregate tok/s, against one stream,
   and against an in-process static padded batch of the same 16 prompts (`model.generate`, greedy,
   min_new_tokens = max_new_tokens; the ceiling on this machine), run in this driver with the replica's thread count.
2. Per-request sampling: 16 concurrent streams that each set their own temperature, top_p and seed, against 16
   greedy ones.
3. Head-of-line: an 8-token request alone, and sent while a 400-token stream is running.
4. The served path's cost: one streamed chat over HTTP against the same chat on the replica's own engine
   (`TextEngine`, same spec and threads) in this driver.

Run:  .venv/bin/python bench/bench_scheduling.py [--reps 3] [--max-tokens 64] [--threads 2]
It starts its own local Ray cluster (ports in 30000-32000) and shuts it down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.router.app import build_router_app

MODEL_ID = "smollm2"
TOPICS = ["dragon", "castle", "robot", "pirate", "forest", "comet", "violin", "desert",
          "glacier", "lighthouse", "volcano", "library", "submarine", "garden", "train", "festival"]
PROMPTS = [f"Write a long story about a {topic}." for topic in TOPICS]


def deploy(http: httpx.Client, state_dir: str, threads: int) -> None:
    spec = {"model_id": MODEL_ID, "which": {"type": "plain", "model_id": SMOLLM2},
            "engine": {"torch_threads": threads, "num_cpus": 0.5}}
    config = {"models": [{"spec": spec, "load": True}], "state_path": str(Path(state_dir) / "registry.json")}
    serve.run(build_router_app(config), name="rayrunner", route_prefix="/",
              logging_config={"enable_access_log": False})
    deadline = time.monotonic() + 600
    while http.post("/v1/models/status", json={"model_id": MODEL_ID}).json().get("status") != "loaded":
        if time.monotonic() > deadline:
            raise RuntimeError("the model did not load within 600 s")
        time.sleep(0.5)


async def stream(client: httpx.AsyncClient, prompt: str, max_tokens: int, **sampling: Any) -> tuple[float, int]:
    """Wall seconds and completion tokens of one streamed chat."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, **sampling}
    start, tokens = time.perf_counter(), 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    return time.perf_counter() - start, tokens


async def aggregate(client: httpx.AsyncClient, max_tokens: int, sampled: bool) -> float:
    """Aggregate tok/s of 16 concurrent streams (each with its own temperature and seed when `sampled`)."""
    def settings(i: int) -> dict[str, Any]:
        return {"temperature": 0.5 + 0.05 * i, "top_p": 0.95, "seed": i} if sampled else {}

    start = time.perf_counter()
    results = await asyncio.gather(*(stream(client, p, max_tokens, **settings(i)) for i, p in enumerate(PROMPTS)))
    return sum(tokens for _, tokens in results) / (time.perf_counter() - start)


async def head_of_line(client: httpx.AsyncClient) -> tuple[float, float]:
    """Seconds of an 8-token request alone, and while a 400-token stream runs."""
    alone, _ = await stream(client, "What is the capital of France?", 8)
    long = asyncio.ensure_future(stream(client, PROMPTS[0], 400))
    await asyncio.sleep(1.0)  # the long one is decoding by now
    during, _ = await stream(client, "What is the capital of France?", 8)
    await long
    return alone, during


class StaticBatch:
    """The 16 prompts as one padded `generate` batch in this process: the machine's ceiling."""

    def __init__(self, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        path = resolve(SMOLLM2).path
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                    tokenize=False) for p in PROMPTS]
        self.inputs = self.tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True)

    def rate(self, tokens: int) -> float:
        start = time.perf_counter()
        with self.torch.inference_mode():
            self.model.generate(**self.inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                                pad_token_id=self.tokenizer.eos_token_id)
        return len(PROMPTS) * tokens / (time.perf_counter() - start)


class InProcessStream:
    """One chat on the replica's own engine in this driver, its events consumed as the replica does."""

    def __init__(self, threads: int) -> None:
        from rayrunner.engines.transformers.text import TextEngine
        from rayrunner.models.spec import build_spec

        self.spec = build_spec(MODEL_ID, {"type": "plain", "model_id": SMOLLM2}, None, {"torch_threads": threads})
        self.engine = TextEngine(self.spec)

    async def rate(self, prompt: str, max_tokens: int) -> float:
        from rayrunner.openai.sampling_params import sampling_params
        from rayrunner.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                                        temperature=0, stream=True)
        start, tokens = time.perf_counter(), 0
        async for event in self.engine.chat(request, sampling_params(request, self.spec.engine)):
            tokens = event.completion_tokens if event.finish_reason else tokens
        return tokens / (time.perf_counter() - start)


async def measure(base: str, args: argparse.Namespace, static: StaticBatch, local: InProcessStream
                  ) -> dict[str, list[float]]:
    rows: dict[str, list[float]] = {k: [] for k in ("one", "greedy16", "static16", "sampled16", "alone", "during",
                                                    "local1")}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await stream(client, "Hi", 4)  # warm-up
        await local.rate("Hi", 4)
        for _ in range(args.reps):
            wall, tokens = await stream(client, PROMPTS[0], args.max_tokens)
            rows["one"].append(tokens / wall)
            rows["local1"].append(await local.rate(PROMPTS[0], args.max_tokens))
            rows["greedy16"].append(await aggregate(client, args.max_tokens, sampled=False))
            rows["static16"].append(await asyncio.to_thread(static.rate, args.max_tokens))
            rows["sampled16"].append(await aggregate(client, args.max_tokens, sampled=True))
            alone, during = await head_of_line(client)
            rows["alone"].append(alone)
            rows["during"].append(during)
    return rows


def report(rows: dict[str, list[float]], args: argparse.Namespace) -> None:
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"\n{cpu_line()}")
    print(f"\nSmolLM2 bf16, CPU, {args.threads} torch threads, {args.max_tokens} tokens, median of {args.reps}")
    print(f"{'case':<52}{'value':>10}")
    for key, label in (("one", "1 stream, tok/s"), ("local1", "1 stream on the same engine in process, tok/s"),
                       ("greedy16", "16 concurrent streams, greedy, aggregate tok/s"),
                       ("sampled16", "16 concurrent, own temperature/seed, aggregate tok/s"),
                       ("static16", "in-process static padded batch of 16, tok/s"),
                       ("alone", "8-token request alone, s"), ("during", "8-token request during a 400-token one, s")):
        print(f"{label:<52}{med[key]:>10.2f}")
    checks = [("1 stream over HTTP / in process", med["one"] / med["local1"], 0.9),
              ("16 streams / 1 stream", med["greedy16"] / med["one"], 7.0),
              ("16 streams / static batch", med["greedy16"] / med["static16"], 0.8),
              ("16 sampled / 16 greedy", med["sampled16"] / med["greedy16"], 0.7),
              ("short during long / alone (at most)", med["during"] / med["alone"], 3.0)]
    print()
    for label, value, target in checks:
        met = value <= target if "at most" in label else value >= target
        print(f"{label:<52}{value:>10.2f}   target {target}: {'met' if met else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (replica + driver)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    base = start_cluster()
    try:
        with tempfile.TemporaryDirectory(prefix="rayrunner-bench-") as state_dir, \
                httpx.Client(base_url=base, timeout=600) as http:
            deploy(http, state_dir, args.threads)
            rows = asyncio.run(measure(base, args, StaticBatch(args.threads), InProcessStream(args.threads)))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    report(rows, args)


if __name__ == "__main__":
    main()
