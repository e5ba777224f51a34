"""The KV memory budget under load, on the builtin SmolLM2 (bf16, CPU) over real HTTP.

SmolLM2 is served with `engine.kv_cache_bytes` set to `--budget-tokens` positions of its KV (23,040 bytes each in
bf16), and `--requests` streamed completions are sent at once, each `--prompt-tokens` prompt tokens and
`--max-tokens` generated (EOS ignored): together far more than the budget holds. Reported: how many completed and
how (finish reasons, errors), the most bytes the replica's caches held after any step (measured from the tensors'
storages; polled from the replica's stats every 0.2 s and taken from its peak), the budget, the preemptions, the
Prometheus counter `ray_rayrunner_preemptions_total`, and whether each reply equals the same request served alone
afterwards (greedy: preemption recomputes exactly, up to bf16 rounding of a batch against a single row).

Run:  .venv/bin/python bench/bench_kv_budget.py [--budget-tokens 2000] [--requests 8] [--prompt-tokens 500]
      [--max-tokens 500]
It starts its own local Ray cluster (ports in 30000-32000) and shuts it down at the end (~5 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import threading
import time
from typing import Any

import httpx
from cpu_kind import cpu_line
from rayrunner_service import rayrunner_service, smollm2_spec, stream_chunks

MODEL = "smollm2"
POSITION_BYTES = 30 * 2 * 3 * 64 * 2  # SmolLM2: layers x (keys, values) x KV heads x head size x bf16


WORDS = ["river", "stone", "lantern", "harbor", "meadow", "candle", "thunder", "orchard", "violin", "glacier",
         "compass", "ember", "falcon", "willow", "copper", "saddle", "prism", "tundra", "beacon", "quiver"]


def prompt(index: int, tokens: int) -> str:
    """`tokens` tokens of distinct text by SmolLM2's tokenizer (seeded by `index`)."""
    from transformers import AutoTokenizer

    from rayrunner.models.sources import SMOLLM2, resolve

    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)
    rng = random.Random(index)
    text = f"Request {index}:" + "".join(f" {rng.choice(WORDS)}" for _ in range(tokens))
    return str(tokenizer.decode(tokenizer(text)["input_ids"][:tokens]))


async def complete(client: httpx.AsyncClient, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    pieces, finish, usage = [], None, None
    try:
        async for chunk in stream_chunks(client, "/v1/completions", body):
            if "error" in chunk:
                return {"error": chunk["error"]}
            for choice in chunk.get("choices", []):
                pieces.append(choice.get("text", ""))
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
    except RuntimeError as exc:  # an HTTP status other than 200
        return {"error": str(exc)}
    return {"text": "".join(pieces), "finish_reason": finish, "usage": usage}


def stats() -> dict[str, int]:
    from ray import serve

    from rayrunner.replica.model_server import DEPLOYMENT

    info: dict[str, Any] = serve.get_deployment_handle(DEPLOYMENT, app_name=MODEL).info.remote().result()
    found: dict[str, int] = info["extra"]["scheduler"]
    return found


def preemptions_metric() -> float | None:
    import ray

    total = None
    for node in ray.nodes():
        if node["Alive"]:
            text = httpx.get(f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics").text
            for value in re.findall(r'ray_rayrunner_preemptions_total\{[^}]*model="smollm2"[^}]*\} ([0-9.e+]+)', text):
                total = (total or 0.0) + float(value)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-tokens", type=int, default=2000)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=500)
    args = parser.parse_args()
    budget = args.budget_tokens * POSITION_BYTES
    spec = smollm2_spec(MODEL)
    spec["engine"] = {"kv_cache_bytes": budget, "max_num_seqs": args.requests}
    with rayrunner_service([spec]) as base:
        held: list[int] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                held.append(stats()["kv_cache_bytes"])
                time.sleep(0.2)

        async def run(texts: list[str]) -> list[dict[str, Any]]:
            async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
                return list(await asyncio.gather(*(complete(client, t, args.max_tokens) for t in texts)))

        texts = [prompt(i, args.prompt_tokens) for i in range(args.requests)]
        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        started = time.monotonic()
        together = asyncio.run(run(texts))
        seconds = time.monotonic() - started
        done.set()
        poller.join()
        figures = stats()
        alone = [asyncio.run(run([text]))[0] for text in texts]
        time.sleep(12)  # the metrics agent exports every few seconds
        metric = preemptions_metric()
    errors = [r for r in together if "error" in r]
    same = sum(a.get("text") == b.get("text") for a, b in zip(together, alone, strict=True))
    print(f"{cpu_line()}\n| figure | value |\n|---|---|\n| requests | {args.requests} x ({args.prompt_tokens} prompt + "
          f"{args.max_tokens} generated tokens) |")
    print(f"| KV budget | {budget:,} bytes ({args.budget_tokens} positions) |")
    print(f"| completed | {len(together) - len(errors)} of {len(together)}, in {seconds:.0f} s; errors: {errors} |")
    print(f"| finish reasons | {sorted({str(r.get('finish_reason')) for r in together})} |")
    print(f"| prompt tokens (usage) | {sorted({r['usage']['prompt_tokens'] for r in together if r.get('usage')})} |")
    print(f"| KV bytes held, most polled | {max(held):,} ({max(held) / budget:.2f} of the budget) |")
    print(f"| KV bytes held, peak after any step | {figures['kv_cache_peak_bytes']:,} "
          f"({figures['kv_cache_peak_bytes'] / budget:.2f} of the budget) |")
    print(f"| preemptions (stats / metric) | {figures['preemptions']} / {metric} |")
    print(f"| replies equal to the same request alone | {same} of {len(texts)} |")


if __name__ == "__main__":
    main()
