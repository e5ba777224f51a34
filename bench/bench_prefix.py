"""Prefix reuse (the prefix KV cache) seen from outside, on the builtin SmolLM2 (bf16, CPU) over real HTTP, with and
without it side by side in one run.

One service serves SmolLM2 twice: `reuse` (shipped engine settings: prefix reuse on) and `noreuse`
(`prefix_caching: false`), both with `torch_threads` `--threads`, `num_cpus` 0.5 and a 2 GB `kv_cache_bytes`. Only one
model is busy at a time. Every request is a streamed greedy chat with `stream_options.include_usage`; TTFT is the time
from sending it to its first chunk with content, and `usage.prompt_tokens_details.cached_tokens` of the final usage
chunk is recorded (shown as `-` when the server does not send it).

1. Chat second turn: a first user message of ~1,500 prompt tokens (numbered sentences, built from a seed, counted with
   SmolLM2's tokenizer and chat template), `max_tokens` 32; then the second turn sends the whole conversation again
   (that message, the assistant's reply exactly as returned, a short new question). TTFT of turn 1 and of turn 2 on
   each model. The like-for-like figure is turn 2 on `reuse` / turn 2 on `noreuse` (the same prompt with and without
   reuse); the issue's target compares turns: turn 2 <= 0.2x turn 1 on `reuse`.
2. Shared system prompt: 16 users at once, each a chat with the same ~1,000-token system prompt and their own short
   question (`max_tokens` 16). TTFT p50 and p90 over the 16, per model. Target: p50 `reuse` <= 0.3x p50 `noreuse`.

Each rep builds new texts (the rep number starts them and seeds the words), so a rep never finds the previous rep's
prompt in the cache; within a rep both models get the same texts (they are separate replicas with separate caches).
Only SmolLM2's default system prompt (~25 tokens, case 1) repeats across reps. The order of the two models alternates
from rep to rep. Figures are medians over `--reps`; noise on a shared box hits both models alike, so compare ratios.

Run:  .venv/bin/python bench/bench_prefix.py [--reps 3] [--threads 2] [--json PATH]
It starts its own local Ray cluster (ports in 30000-32000) and shuts it down at the end (~6 minutes on a 2-core box).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from cpu_kind import cpu_line
from rayrunner_service import rayrunner_service, smollm2_spec, stream_chunks

from rayrunner.models.sources import SMOLLM2, resolve

MODELS = ("reuse", "noreuse")
CHAT_TOKENS = 1500  # prompt tokens of turn 1 (chat template included)
SYSTEM_TOKENS = 1000  # prompt tokens of the shared system prompt alone (in its template turn)
USERS = 16
SETTLE_S = 10.0  # after the loads, until the warm spare worker each leaves behind has imported
TARGETS = {"turn 2 / turn 1 TTFT on reuse": 0.2, "shared prompt p50 TTFT reuse / noreuse": 0.3}

ADJECTIVES = ["red", "quiet", "ancient", "tiny", "bright", "heavy", "curious", "frozen", "golden", "hollow", "noisy",
              "gentle", "crooked", "distant", "silver", "patient"]
NOUNS = ["dragon", "castle", "robot", "pirate", "forest", "comet", "violin", "desert", "glacier", "lighthouse",
         "volcano", "library", "submarine", "garden", "train", "festival", "teapot", "harbour", "clock", "meadow"]
VERBS = ["watches", "follows", "repairs", "paints", "guards", "visits", "measures", "remembers", "carries", "ignores"]
PLACES = ["the river", "the old bridge", "the market", "the hill", "the station", "the north gate", "the bakery",
          "the school", "the mill", "the harbour wall"]


def engine(threads: int, prefix_caching: bool) -> dict[str, Any]:
    settings: dict[str, Any] = {"torch_threads": threads, "num_cpus": 0.5, "kv_cache_bytes": 2_000_000_000}
    if not prefix_caching:
        settings["prefix_caching"] = False
    return settings


def specs(threads: int) -> list[dict[str, Any]]:
    return [{**smollm2_spec("reuse"), "engine": engine(threads, True)},
            {**smollm2_spec("noreuse"), "engine": engine(threads, False)}]


class Texts:
    """Deterministic prompts sized in SmolLM2's tokens (its tokenizer and chat template, as the server counts)."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)

    def count(self, messages: list[dict[str, str]]) -> int:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def sized(self, head: str, seed: str, tail: str, tokens: int, wrap: Any) -> str:
        """`head`, numbered sentences drawn from `seed`, `tail`: the fewest sentences that make `wrap(text)` (a chat)
        at least `tokens` long."""
        rng = random.Random(seed)
        sentences: list[str] = []
        while True:
            text = " ".join([head, *sentences, tail])
            if self.count(wrap(text)) >= tokens:
                return text
            sentences.append(f"{len(sentences) + 1}. The {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} "
                             f"{rng.choice(VERBS)} the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} near "
                             f"{rng.choice(PLACES)}.")

    def chat(self, rep: int) -> str:
        """Turn 1's user message of rep `rep` (rep -1: the warm-up)."""
        return self.sized(f"Notebook {rep}: {random.Random(f'chat-{rep}').getrandbits(64):x}. Here are my notes.",
                          f"chat-{rep}", "Summarise these notes in two sentences.", CHAT_TOKENS,
                          lambda text: [{"role": "user", "content": text}])

    def system(self, rep: int) -> str:
        """The system prompt every user shares in rep `rep`."""
        return self.sized(f"Session {rep}: {random.Random(f'system-{rep}').getrandbits(64):x}. You are the clerk of a "
                          "town archive. The archive's records, which you answer questions about:", f"system-{rep}",
                          "Answer briefly and cite the record's number.", SYSTEM_TOKENS,
                          lambda text: [{"role": "system", "content": text}])


def question(user: int) -> str:
    return f"I am visitor {user}. What does the archive say about the {NOUNS[user % len(NOUNS)]}?"


@dataclass
class Reply:
    ttft: float  # seconds to the first chunk with content (to the end when none had content)
    wall: float
    text: str
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None


async def chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int) -> Reply:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    async for chunk in stream_chunks(client, "/v1/chat/completions", body):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                first = first or time.perf_counter()
                parts.append(content)
    end = time.perf_counter()
    details = usage.get("prompt_tokens_details") or {}
    return Reply(ttft=(first or end) - start, wall=end - start, text="".join(parts),
                 prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
                 cached_tokens=details.get("cached_tokens"))


async def second_turn(client: httpx.AsyncClient, model: str, first_message: str) -> dict[str, Reply]:
    """Case 1: a long first turn, then the whole conversation again with a short new question."""
    conversation = [{"role": "user", "content": first_message}]
    turn1 = await chat(client, model, conversation, 32)
    conversation += [{"role": "assistant", "content": turn1.text},
                     {"role": "user", "content": "Thanks. Which note mentions a lighthouse? One sentence."}]
    turn2 = await chat(client, model, conversation, 32)
    return {"turn1": turn1, "turn2": turn2}


async def shared_system(client: httpx.AsyncClient, model: str, system: str) -> list[Reply]:
    """Case 2: `USERS` chats at once, one system prompt, each user their own question."""
    return list(await asyncio.gather(*(
        chat(client, model, [{"role": "system", "content": system}, {"role": "user", "content": question(user)}], 16)
        for user in range(USERS))))


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[8]


async def measure(base: str, args: argparse.Namespace, texts: Texts) -> list[dict[str, Any]]:
    reps: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        warm_chat, warm_system = texts.chat(-1), texts.system(-1)
        for model in MODELS:  # warm-up: a long prefill, a second turn and a concurrent batch, on texts no rep uses
            await second_turn(client, model, warm_chat)
            await asyncio.gather(*(chat(client, model, [{"role": "system", "content": warm_system},
                                                        {"role": "user", "content": question(user)}], 4)
                                   for user in range(4)))
        for rep in range(args.reps):
            first_message, system = texts.chat(rep), texts.system(rep)
            order = MODELS if rep % 2 == 0 else MODELS[::-1]
            row: dict[str, Any] = {"rep": rep, "order": list(order)}
            for model in order:
                row[f"chat/{model}"] = await second_turn(client, model, first_message)
            for model in order:
                row[f"shared/{model}"] = await shared_system(client, model, system)
            reps.append(row)
            print(f"rep {rep + 1}/{args.reps} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    return reps


def summary(reps: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model, medians over the reps: TTFTs, prompt and cached tokens."""
    def med(values: list[float | int | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    out: dict[str, dict[str, Any]] = {}
    for model in MODELS:
        chats = [rep[f"chat/{model}"] for rep in reps]
        shared = [rep[f"shared/{model}"] for rep in reps]
        out[model] = {
            **{f"{turn}_{field}": med([getattr(c[turn], field) for c in chats])
               for turn in ("turn1", "turn2") for field in ("ttft", "prompt_tokens", "cached_tokens")},
            "shared_p50": med([statistics.median(r.ttft for r in replies) for replies in shared]),
            "shared_p90": med([p90([r.ttft for r in replies]) for replies in shared]),
            "shared_prompt_tokens": med([statistics.median(r.prompt_tokens or 0 for r in replies)
                                         for replies in shared]),
            "shared_cached_tokens": med([med([r.cached_tokens for r in replies]) for replies in shared]),
        }
    return out


def report(figures: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, float]:
    def num(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    print(f"\n{cpu_line()}\nSmolLM2 bf16, CPU, {args.threads} torch threads, median of {args.reps} reps; "
          "cached = usage.prompt_tokens_details.cached_tokens (median over requests)\n")
    print("| case | model | TTFT s | prompt tokens | cached tokens |")
    print("|---|---|---:|---:|---:|")
    for model in MODELS:
        f = figures[model]
        for turn, label in (("turn1", "chat, turn 1"), ("turn2", "chat, turn 2")):
            print(f"| {label} | {model} | {num(f[f'{turn}_ttft'], '.3f')} | {num(f[f'{turn}_prompt_tokens'], '.0f')} "
                  f"| {num(f[f'{turn}_cached_tokens'], '.0f')} |")
    for model in MODELS:
        f = figures[model]
        print(f"| {USERS} users, shared system prompt, p50 (p90) | {model} | {num(f['shared_p50'], '.3f')} "
              f"({num(f['shared_p90'], '.3f')}) | {num(f['shared_prompt_tokens'], '.0f')} "
              f"| {num(f['shared_cached_tokens'], '.0f')} |")
    reuse, noreuse = figures["reuse"], figures["noreuse"]
    ratios = {
        "turn 2 TTFT reuse / noreuse (like for like)": reuse["turn2_ttft"] / noreuse["turn2_ttft"],
        "turn 2 / turn 1 TTFT on reuse": reuse["turn2_ttft"] / reuse["turn1_ttft"],
        "turn 2 / turn 1 TTFT on noreuse": noreuse["turn2_ttft"] / noreuse["turn1_ttft"],
        "shared prompt p50 TTFT reuse / noreuse": reuse["shared_p50"] / noreuse["shared_p50"],
        "shared prompt p90 TTFT reuse / noreuse": reuse["shared_p90"] / noreuse["shared_p90"],
    }
    print("\n| ratio | value | target |")
    print("|---|---:|---|")
    for label, value in ratios.items():
        target = TARGETS.get(label)
        verdict = "" if target is None else f"<= {target}: {'met' if value <= target else 'NOT met'}"
        print(f"| {label} | {value:.2f} | {verdict} |")
    print("SUMMARY: " + ", ".join(f"{label} {value:.2f}" for label, value in ratios.items()))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each replica (default 2)")
    parser.add_argument("--json", type=Path, help="write the raw figures (every request) here")
    args = parser.parse_args()
    started = time.monotonic()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)", flush=True)
    texts = Texts()
    with rayrunner_service(specs(args.threads)) as base:
        print(f"loaded in {time.monotonic() - started:.0f} s; settling {SETTLE_S:.0f} s", flush=True)
        time.sleep(SETTLE_S)
        reps = asyncio.run(measure(base, args, texts))
    print(f"load average at end: {os.getloadavg()[0]:.2f}; run took {time.monotonic() - started:.0f} s")
    figures = summary(reps)
    ratios = report(figures, args)
    if args.json:
        raw = [{key: ([asdict(r) for r in value] if isinstance(value, list) and key.startswith("shared/") else
                      {turn: asdict(r) for turn, r in value.items()} if key.startswith("chat/") else value)
                for key, value in rep.items()} for rep in reps]
        args.json.write_text(json.dumps({"args": {"reps": args.reps, "threads": args.threads},
                                         "specs": specs(args.threads), "medians": figures, "ratios": ratios,
                                         "reps": raw}, indent=1))
        print(f"raw figures written to {args.json}")


if __name__ == "__main__":
    main()
