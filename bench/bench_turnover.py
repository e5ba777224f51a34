"""Streams that finish and are replaced, in process: rows leaving and joining the running batch's KV room in place
(`kv_batch`: a finished row's place taken by a row from the end, a new prompt in a freed row) against gathering every
layer anew at each finish and join (what the cache did before; the bench switches the two in-room paths off).

`--streams` sequences of SmolLM2 bf16 decode together through the step scheduler (fast decode step and prefix cache
as a replica runs them); each has a ~124-token prompt whose first 32 tokens all share (a chat template's system
part, which the prefix cache then serves) and `--max-tokens` tokens with `ignore_eos`; a finished one is replaced at
once, so after a staggered start prompts join while others decode, as under a steady load. Output tok/s over
`--steps` steps, the two sides alternating for `--rounds` rounds in one process; the median of each and their ratio.

Run: `.venv/bin/python bench/bench_turnover.py [--threads 1] [--streams 16] [--rounds 3] [--steps 300]`
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from bench_decode_step import load
from cpu_kind import cpu_line

from rayrunner.engines.transformers.kv import kv_batch
from rayrunner.engines.transformers.step import scheduler as scheduler_module

PROMPT_TOKENS, SHARED_TOKENS = 124, 32


@contextmanager
def gathering() -> Iterator[None]:
    """Rows leave and join by gathering every layer anew (the in-room paths off, rows kept in their order)."""
    keep, merge, order = (kv_batch.BatchCache._keep_in_room, kv_batch.BatchCache._merge_in_room,
                          scheduler_module.compacted_rows)
    kv_batch.BatchCache._keep_in_room = lambda self, rows: False  # type: ignore[method-assign]
    kv_batch.BatchCache._merge_in_room = lambda self, other: False  # type: ignore[method-assign]
    scheduler_module.compacted_rows = lambda done: [row for row, gone in enumerate(done) if not gone]
    try:
        yield
    finally:
        kv_batch.BatchCache._keep_in_room, kv_batch.BatchCache._merge_in_room = keep, merge  # type: ignore[method-assign]
        scheduler_module.compacted_rows = order


class Load:
    """Sequences submitted to a scheduler, each replaced by a new one when it finishes."""

    def __init__(self, model: Any, streams: int, max_tokens: int, seed: int) -> None:
        from transformers import AutoTokenizer

        from rayrunner.engines.transformers.step.fast_decode import FastDecode
        from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler
        from rayrunner.models.sources import SMOLLM2, resolve

        self.scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=streams))
        self.scheduler.fast_decode = FastDecode.for_model(model)
        self.tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)
        self.loop = asyncio.new_event_loop()
        self.random = random.Random(seed)
        self.shared = self._tokens(SHARED_TOKENS)
        self.max_tokens = max_tokens
        self.live = [self._submit() for _ in range(streams)]
        self.finished_tokens = 0

    def _tokens(self, count: int) -> list[int]:
        return [self.random.randrange(10, 4000) for _ in range(count)]

    def _submit(self) -> Any:
        from rayrunner.engines.detokenizer import Detokenizer
        from rayrunner.engines.transformers.step.sequence import Sequence
        from rayrunner.openai.sampling_params import SamplingParams

        sequence = Sequence(self.shared + self._tokens(PROMPT_TOKENS - SHARED_TOKENS),
                            SamplingParams(max_tokens=self.max_tokens, ignore_eos=True),
                            Detokenizer(self.tokenizer, []), set(), self.loop)
        self.scheduler.submit(sequence)
        return sequence

    def step(self) -> None:
        self.scheduler.step()
        for place, sequence in enumerate(self.live):
            if sequence.done:
                self.finished_tokens += len(sequence.output_ids)
                self.live[place] = self._submit()

    def tokens(self) -> int:
        return self.finished_tokens + sum(len(s.output_ids) for s in self.live)


@torch.inference_mode()
def rate(model: Any, args: argparse.Namespace, seed: int) -> float:
    """Output tok/s of `args.steps` steps after a staggered start of as many steps as a stream's length."""
    load_ = Load(model, args.streams, args.max_tokens, seed)
    for _ in range(args.max_tokens):
        load_.step()
    started, before = time.perf_counter(), load_.tokens()
    for _ in range(args.steps):
        load_.step()
    return (load_.tokens() - before) / (time.perf_counter() - started)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)


def compare(model: Any, args: argparse.Namespace, sides: dict[str, Callable[[], Any]], level: str) -> dict[str, float]:
    """Each side's output tok/s on this load, the sides alternating for `args.rounds` rounds; the table printed with
    the CPU's kind, and each side's median returned."""
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        for side, mode in sides.items():
            with mode():
                rates[side].append(rate(model, args, seed=round_))
    print(cpu_line())
    print(f"SmolLM2 {level}, {args.streams} streams of {args.max_tokens} tokens replaced as they finish, "
          f"{PROMPT_TOKENS}-token prompts, torch threads {args.threads}, {args.steps} steps a round")
    print("| side | tok/s by round | median |\n|---|---|---|")
    for side, figures in rates.items():
        print(f"| {side} | {', '.join(f'{f:.1f}' for f in figures)} | {statistics.median(figures):.1f} |")
    return {side: statistics.median(figures) for side, figures in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    medians = compare(load("bf16"), args, {"gather anew": gathering, "in room": nullcontext}, "bf16")
    print(f"SUMMARY: in room / gather anew {medians['in room'] / medians['gather anew']:.3f}x")

if __name__ == "__main__":
    main()
