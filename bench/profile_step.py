"""Where one decode step of rayrunner's own engine spends its time: SmolLM2 (builtin, bf16 or an ISQ level) with
`--rows` sequences decoding together in process, the step loop as a replica runs it (fast decode step included),
`--steps` steps under torch's profiler. Ops are grouped (matmuls, attention, KV cache moves, sampling, other ops),
and what the ops do not account for is the step's Python (scheduler, planner, sequences, detokenizer).

Run: `.venv/bin/python bench/profile_step.py [--level bf16] [--rows 16] [--context 100] [--steps 20]`
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import defaultdict
from typing import Any

import torch
from bench_decode_step import load
from cpu_kind import cpu_line
from torch.profiler import ProfilerActivity, profile

# First match wins: attention's bmm before the weights' mm, sampling's log_softmax before attention's softmax.
GROUPS = {
    "sampling": ("argmax", "topk", "multinomial", "sort", "cumsum", "log_softmax", "exponential"),
    "attention (bmm, softmax, SDPA)": ("bmm", "scaled_dot_product", "flash_attention", "softmax"),
    "weight matmuls": ("mm", "linear", "matmul", "_int_mm", "_weight_int8pack_mm", "int8", "mkldnn"),
    "KV cache moves": ("copy_", "cat", "index_put", "index_copy", "slice_scatter", "narrow", "clone", "contiguous"),
}


def group_of(name: str) -> str:
    op = name.removeprefix("aten::")
    return next((group for group, keys in GROUPS.items() if any(key in op for key in keys)), "other ops")


def sequences(scheduler: Any, rows: int, context: int, steps: int, loop: asyncio.AbstractEventLoop) -> list[Any]:
    from transformers import AutoTokenizer

    from rayrunner.engines.detokenizer import Detokenizer
    from rayrunner.engines.transformers.step.sequence import Sequence
    from rayrunner.models.sources import SMOLLM2, resolve
    from rayrunner.openai.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)
    params = SamplingParams(max_tokens=3 * steps + 60, ignore_eos=True)
    made = [Sequence([(31 * t + 7 * i) % 4000 + 10 for t in range(context)], params, Detokenizer(tokenizer, []),
                     set(), loop) for i in range(rows)]
    for sequence in made:
        scheduler.submit(sequence)
    return made


@torch.inference_mode()
def profile_steps(level: str, rows: int, context: int, steps: int) -> None:
    from rayrunner.engines.transformers.step.fast_decode import FastDecode
    from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler

    model = load(level)
    scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=rows))
    scheduler.fast_decode = FastDecode.for_model(model)
    loop = asyncio.new_event_loop()
    sequences(scheduler, rows, context, steps, loop)
    while scheduler.stats()["waiting"] or scheduler.stats()["running"] < rows:  # every row prefilled
        scheduler.step()
    timed(scheduler, 10)  # the batch's cache settles (room reserved ahead)
    plain_ms = timed(scheduler, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall_ms = timed(scheduler, steps)
    plain_ms = min(plain_ms, timed(scheduler, steps))
    print(cpu_line())
    print(f"SmolLM2 {level}, {rows} rows, ~{context}-token context, torch threads {torch.get_num_threads()}: "
          f"{plain_ms:.1f} ms a step ({rows * 1000 / plain_ms:.1f} tok/s); {wall_ms:.1f} ms under the profiler")
    report(prof, wall_ms, steps)


def timed(scheduler: Any, steps: int) -> float:
    """Milliseconds a step, over `steps` steps."""
    started = time.perf_counter()
    for _ in range(steps):
        scheduler.step()
    return (time.perf_counter() - started) * 1000 / steps


def report(prof: Any, wall_ms: float, steps: int) -> None:
    """Each group's self CPU time a step, and its share of the profiled step."""
    spent: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        spent[group_of(event.key)] += event.self_cpu_time_total / 1000 / steps
    ops_ms = sum(spent.values())
    print("| part (under the profiler) | ms a step | share |\n|---|---|---|")
    for group, ms in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"| {group} | {ms:.1f} | {ms / wall_ms:.0%} |")
    python_ms = max(0.0, wall_ms - ops_ms)
    print(f"| not in ops (Python: loop, planner, sequences, detokenizer; the profiler's own) | {python_ms:.1f} | "
          f"{python_ms / wall_ms:.0%} |")
    print("\nTop ops by self CPU time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", default="bf16", help="bf16, or an ISQ level such as Q8_0")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    profile_steps(args.level, args.rows, args.context, args.steps)


if __name__ == "__main__":
    main()
