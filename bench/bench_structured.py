"""Structured-output benchmark on the builtin SmolLM2, in process: what a JSON Schema costs a decode.

Run: `python bench/bench_structured.py [--rounds 3] [--tokens 96] [--streams 1 8] [--walks 3]`.

Decode: `--streams` concurrent greedy chats of the same prompt through `TextEngine.chat` (so the step scheduler runs
them as it does when serving), aggregate completion tok/s, with and without the schema below, both sides in each
round (after a warm-up round, in an order that flips every round); medians of `--rounds` rounds, and the median of
the rounds' paired ratios. A constrained reply may end with its JSON before `--tokens`: the table shows both counts.

Masks: per-token cost of the grammar libraries on SmolLM2's tokenizer along one tokenized instance of the schema
(mean and p99 over `--walks` walks; xgrammar only if installed), and of rayrunner's whole processor call (advance +
mask + apply to the logits).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from cpu_kind import cpu_line
from transformers import AutoConfig, AutoTokenizer

from rayrunner.engines.transformers.constrained import Grammars
from rayrunner.engines.transformers.text import TextEngine
from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.openai.structured_output import json_target
from rayrunner.protocol import ChatCompletionRequest

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "email": {"type": "string", "format": "email"},
        "address": {"type": "object", "additionalProperties": False, "required": ["street", "city", "zip"],
                    "properties": {"street": {"type": "string", "maxLength": 60},
                                   "city": {"type": "string", "maxLength": 40},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 5},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "email", "address", "skills", "scores", "active"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "role": "engineer", "email": "ada@example.org",
            "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
            "skills": ["mathematics", "poetry", "engines", "notes"], "scores": [0.97, 0.5, 0.125], "active": True}
PROMPT = "Describe a fictional employee as JSON: name, age, role, email, address, skills, scores, active."


async def chats(engine: TextEngine, grammars: Grammars, streams: int, tokens: int,
                constrained: bool) -> tuple[float, float]:
    """Aggregate tok/s and mean completion tokens of `streams` concurrent greedy chats. A constrained request carries
    `response_format` and its params the constraint, whether or not the engine derives one from the other."""
    fmt = {"type": "json_schema", "json_schema": {"name": "employee", "schema": SCHEMA}} if constrained else None
    request = ChatCompletionRequest(messages=[{"role": "user", "content": PROMPT}], response_format=fmt)

    async def one() -> int:
        params = SamplingParams(max_tokens=tokens, constraint=grammars.for_target(json_target(request)))
        events = [event async for event in engine.chat(request, params)]
        return events[-1].completion_tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one() for _ in range(streams)))
    return sum(counts) / (time.perf_counter() - start), statistics.mean(counts)


def decode(engine: TextEngine, streams: list[int], tokens: int, rounds: int) -> None:
    """Each round runs both sides back to back, in an order that flips every round; the ratio is the median of the
    rounds' paired ratios, which a shared machine's load swings move much less than either side's tok/s."""
    grammars = Grammars(engine.tokenizer, engine.eos_ids, engine.model.config.vocab_size)
    samples: dict[tuple[int, bool], list[tuple[float, float]]] = {}
    loop = asyncio.new_event_loop()
    try:
        for round_ in range(rounds + 1):
            for n in streams:
                for constrained in ((False, True) if round_ % 2 else (True, False)):
                    result = loop.run_until_complete(chats(engine, grammars, n, tokens, constrained))
                    if round_:
                        samples.setdefault((n, constrained), []).append(result)
    finally:
        loop.close()
    print(f"{'streams':>7} {'plain tok/s':>11} {'tokens':>6} {'schema tok/s':>12} {'tokens':>6} {'ratio':>6}")
    ratios = []
    for n in streams:
        plain, schema = (statistics.median(s for s, _ in samples[n, c]) for c in (False, True))
        plain_tokens, schema_tokens = (statistics.mean(t for _, t in samples[n, c]) for c in (False, True))
        ratio = statistics.median(c[0] / p[0] for p, c in zip(samples[n, False], samples[n, True], strict=True))
        ratios.append(f"x{n} {ratio:.2f}")
        print(f"{n:7d} {plain:11.1f} {plain_tokens:6.0f} {schema:12.1f} {schema_tokens:6.0f} {ratio:5.2f}x")
    print("SUMMARY: schema/plain decode tok/s (median paired ratio) " + ", ".join(ratios))


def timed_walk(ids: list[int], walks: int, start: Callable[[], Callable[[int], None]]) -> list[float]:
    """Seconds per token of `step(token)` (mask for the position, then advance by `token`), over `walks` walks."""
    seconds = []
    for _ in range(walks):
        step = start()
        for token in ids:
            began = time.perf_counter()
            step(token)
            seconds.append(time.perf_counter() - began)
    return seconds


def mask_costs(walks: int) -> None:
    """Before any engine starts: torch ops from a thread other than the engine's compute thread would pay for
    waking a second OpenMP pool (see `rayrunner.engines.transformers.step.compute_thread`)."""
    folder = resolve(SMOLLM2).path
    tokenizer, vocab = AutoTokenizer.from_pretrained(folder), AutoConfig.from_pretrained(folder).vocab_size
    eos_ids = {tokenizer.eos_token_id}
    ids = tokenizer(json.dumps(INSTANCE), add_special_tokens=False)["input_ids"]
    rows: list[tuple[str, float, float, list[float]]] = []  # name, tokenizer index s, schema compile s, per token

    began = time.perf_counter()
    grammars = Grammars(tokenizer, eos_ids, vocab)
    indexed = time.perf_counter()
    factory = grammars.json_schema(SCHEMA)
    index_s, compile_s = indexed - began, time.perf_counter() - indexed

    def processor_walk() -> Callable[[int], None]:
        processor, output = factory(), list[int]()

        def step(token: int) -> None:
            processor([], output, torch.from_numpy(np.zeros(vocab, dtype=np.float32)))  # no OpenMP fill
            output.append(token)
        return step

    def llguidance_walk() -> Callable[[int], None]:
        matcher = factory().matcher  # type: ignore[attr-defined]
        words = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

        def step(token: int) -> None:
            matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
            matcher.consume_token(token)
        return step

    def walk(start: Callable[[], Callable[[int], None]]) -> list[float]:
        return timed_walk(ids, walks, start)

    rows.append(("llguidance matcher", index_s, compile_s, walk(llguidance_walk)))
    rows.append(("rayrunner processor", index_s, compile_s, walk(processor_walk)))
    try:
        import xgrammar
    except ImportError:
        print("xgrammar is not installed: its row is skipped")
    else:
        began = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                       stop_token_ids=sorted(eos_ids))
        compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        indexed = time.perf_counter()
        compiled = compiler.compile_json_schema(SCHEMA, max_whitespace_cnt=16)
        xgr_index_s, xgr_compile_s = indexed - began, time.perf_counter() - indexed

        def xgrammar_walk() -> Callable[[int], None]:
            matcher, bitmask = xgrammar.GrammarMatcher(compiled), xgrammar.allocate_token_bitmask(1, vocab)

            def step(token: int) -> None:
                matcher.fill_next_token_bitmask(bitmask)
                matcher.accept_token(token)
            return step

        rows.append(("xgrammar matcher", xgr_index_s, xgr_compile_s, walk(xgrammar_walk)))
    print(f"per-token mask cost along {len(ids)} tokens x {walks} walks; tokenizer index (once per engine) and "
          "schema compile (once per request)")
    print(f"{'':20} {'index ms':>8} {'compile ms':>10} {'mean us':>8} {'p99 us':>7}")
    for name, index, compile_, seconds in rows:
        p99 = sorted(seconds)[int(0.99 * (len(seconds) - 1))]
        print(f"{name:20} {index * 1e3:8.0f} {compile_ * 1e3:10.1f} {statistics.mean(seconds) * 1e6:8.0f} "
              f"{p99 * 1e6:7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", nargs="*", type=int, default=[1, 8], help="concurrent chats per measurement")
    parser.add_argument("--tokens", type=int, default=96, help="max greedy tokens per chat")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (the median is shown)")
    parser.add_argument("--walks", type=int, default=3, help="walks along the instance for the mask costs")
    args = parser.parse_args()
    print(f"{cpu_line()}")
    print(f"SmolLM2-135M-Instruct bf16, CPU, {torch.get_num_threads()} threads; decode: up to {args.tokens} greedy "
          f"tokens per chat, median of {args.rounds} rounds")
    mask_costs(args.walks)
    print()
    engine = TextEngine(build_spec("smollm2", {"type": "plain", "model_id": SMOLLM2}))
    try:
        decode(engine, args.streams, args.tokens, args.rounds)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
