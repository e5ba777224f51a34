"""Total throughput of one rayrunner service when several of its models are busy at once, against each model alone,
over real HTTP, in one run.

The service starts with the builtin SmolLM2 (bf16, `smollm2`); two copies are added at runtime through
`POST /v1/models/add`, as a user would: `smollm2-q8_0` (quantized in situ to Q8_0) and `smollm2-copy` (bf16 under
another id). All three keep their shipped engine settings, so what is measured is how the replicas share the node's
cores on their own. Cases, one after another: each model alone, the first two busy at once, all three busy at once.
In each case every busy model gets `--streams` concurrent streamed greedy chats, each asking `--max-tokens` tokens
with `ignore_eos` and `min_tokens` (a server that ignores them stops early: the tokens per request it reported are
shown), each stream sending its next request as soon as one ends.

Figures: output tok/s of each model over a `--duration` window that starts `--ramp` seconds after the load does (so
every model is busy across the whole window; tokens are counted by their arrival time), their total, and the ratios
(2 busy) / (mean of those two alone) and (3 busy) / (mean of the three alone), with the targets of issue 26
(>= 0.85 and >= 0.8). The client is one asyncio loop (httpx) in this process, with little work per token.
The cases start `--settle` seconds after the last load, once the warm spare worker it leaves behind
(`rayrunner.runtime.warm_workers`) has finished importing: otherwise the first case shares the cores with it.

Run:  .venv/bin/python bench/bench_multimodel.py [--streams 8] [--duration 30] [--ramp 5] [--settle 10] [--engine JSON]
It starts its own local Ray cluster (ports in 30000-32000) and shuts it down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx
from bench_scheduling import PROMPTS
from cpu_kind import cpu_line
from rayrunner_service import BASE_ID, add_model, rayrunner_service, smollm2_spec, stream_chunks

COPIES = [smollm2_spec(f"{BASE_ID}-q8_0", "Q8_0"), smollm2_spec(f"{BASE_ID}-copy")]
MODELS = [BASE_ID] + [spec["model_id"] for spec in COPIES]
TARGETS = {2: 0.85, 3: 0.8}


@dataclass
class Reply:
    """One streamed chat: when each chunk with content arrived, and the completion tokens the server counted."""

    chunk_times: list[float] = field(default_factory=list)
    tokens: int = 0


async def chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Reply:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0, "ignore_eos": True, "min_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    reply = Reply()
    async for chunk in stream_chunks(client, "/v1/chat/completions", body):
        if chunk.get("usage"):
            reply.tokens = chunk["usage"]["completion_tokens"]
        if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
            reply.chunk_times.append(time.perf_counter())
    return reply


async def stream_until(stop: asyncio.Event, client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int,
                       replies: list[Reply]) -> None:
    """One client stream: a request after another until `stop` is set (the last one is let finish)."""
    while not stop.is_set():
        replies.append(await chat(client, model, prompt, max_tokens))


def tokens_between(replies: list[Reply], start: float, end: float) -> float:
    """Completion tokens that arrived in [start, end): each reply's tokens spread over its content chunks."""
    total = 0.0
    for reply in replies:
        if reply.chunk_times:
            inside = sum(start <= t < end for t in reply.chunk_times)
            total += inside * reply.tokens / len(reply.chunk_times)
    return total


@dataclass(frozen=True)
class Case:
    """One case's result: output tok/s of each busy model over the window, and mean tokens per request."""

    rates: dict[str, float]
    tokens_per_request: float

    @property
    def total(self) -> float:
        return sum(self.rates.values())


async def busy(base: str, models: list[str], args: argparse.Namespace) -> Case:
    """Drive `models` at once, `args.streams` streams each, and count what arrives in the window."""
    stop = asyncio.Event()
    replies: dict[str, list[Reply]] = {model: [] for model in models}
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        tasks = [asyncio.create_task(stream_until(stop, client, model, PROMPTS[i % len(PROMPTS)], args.max_tokens,
                                                  replies[model]))
                 for model in models for i in range(args.streams)]
        start = time.perf_counter() + args.ramp
        await asyncio.sleep(args.ramp + args.duration)
        stop.set()
        await asyncio.gather(*tasks)
    rates = {model: tokens_between(r, start, start + args.duration) / args.duration for model, r in replies.items()}
    tokens = [reply.tokens for r in replies.values() for reply in r]
    return Case(rates, statistics.mean(tokens) if tokens else 0.0)


async def measure(base: str, args: argparse.Namespace) -> dict[str, Case]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        for model in MODELS:  # warm-up: each model's first request
            await chat(client, model, "Hi", 4)
    await asyncio.sleep(args.settle)
    cases: dict[str, Case] = {}
    for model in MODELS:
        cases[model] = await busy(base, [model], args)
        print(f"{model} alone: {cases[model].total:.1f} tok/s", flush=True)
    for count in (2, 3):
        cases[f"{count} busy"] = await busy(base, MODELS[:count], args)
        print(f"{count} busy: {cases[f'{count} busy'].total:.1f} tok/s", flush=True)
    return cases


def report(cases: dict[str, Case], args: argparse.Namespace) -> None:
    print(f"\n{cpu_line()}")
    print(f"\nSmolLM2-135M-Instruct, CPU, {args.streams} streams per busy model, {args.max_tokens} tokens asked a "
          f"request (ignore_eos), greedy, {args.duration:.0f} s window; one run\n")
    print("| case | total output tok/s | per model tok/s | tokens / request |")
    print("|---|---|---|---|")
    for name, case in cases.items():
        label = f"{name} alone" if name in MODELS else name
        per_model = ", ".join(f"{model} {rate:.1f}" for model, rate in case.rates.items())
        print(f"| {label} | {case.total:.1f} | {per_model} | {case.tokens_per_request:.1f} |")
    print("\n| ratio | value | target |")
    print("|---|---|---|")
    for count, target in TARGETS.items():
        alone = statistics.mean(cases[model].total for model in MODELS[:count])
        ratio = cases[f"{count} busy"].total / alone
        print(f"| ({count} busy) / mean of those {count} alone | {ratio:.2f}x | >= {target} "
              f"({'met' if ratio >= target else 'NOT met'}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per busy model")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds counted per case")
    parser.add_argument("--ramp", type=float, default=5.0, help="seconds of load before the window opens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--settle", type=float, default=10.0,
                        help="idle seconds before the first case (the warm spare worker a load leaves imports then)")
    parser.add_argument("--engine", type=json.loads, default={}, metavar="JSON",
                        help="engine settings of every model, e.g. '{\"prefill_aside\": false}'")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); engine settings {args.engine}")
    specs = [{**spec, "engine": args.engine} for spec in [smollm2_spec(BASE_ID), *COPIES]]
    with rayrunner_service(specs[:1]) as base:
        with httpx.Client(base_url=base, timeout=900) as http:
            for spec in specs[1:]:
                add_model(http, spec)
        cases = asyncio.run(measure(base, args))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    report(cases, args)


if __name__ == "__main__":
    main()
