"""A decode step with its layers in one C call (`rayrunner.engines.transformers.step.decode_layers`) against the same
fast step calling its kernels one by one from Python, in process, on the builtin SmolLM2 bf16, alternating.

The step is the scheduler's, as `profile_step.py` drives it (every row decoding, `--context` tokens of prompt);
each round times `--steps` steps each way on the same batch (its context grows by both), at every `--rows` and
`--threads`. Figures: ms a step, medians of the rounds, and the ratio; and how the step scales from one thread to two.

Run:  .venv/bin/python bench/bench_decode_layers.py [--rows 1 8 16] [--threads 1 2] [--context 130] [--steps 30]
                                                   [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_decode_step import load
from bench_tile_gemm import decoding
from cpu_kind import cpu_line
from profile_step import timed


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--context", type=int, default=130)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(cpu_line())
    model = load("bf16")
    print("\n| rows | threads | one C call (ms) | from Python (ms) | C / Python |\n|---|---|---|---|---|")
    medians: dict[tuple[int, int], tuple[float, float]] = {}
    for rows in args.rows:
        for threads in args.threads:
            torch.set_num_threads(threads)
            scheduler = decoding(model, rows, args.context, args.steps)
            fast = scheduler.fast_decode
            driver = fast.driver
            if driver is None:
                raise SystemExit("the layers in C do not apply here (no AMX tiles, no compiler, or switched off)")
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for in_c in (True, False):
                    fast.driver = driver if in_c else None
                    times[in_c].append(timed(scheduler, args.steps))
            fast.driver = driver
            c_ms, python_ms = (statistics.median(times[side]) for side in (True, False))
            medians[rows, threads] = c_ms, python_ms
            print(f"| {rows} | {threads} | {c_ms:.1f} | {python_ms:.1f} | {c_ms / python_ms:.2f}x |")
    for rows in args.rows:
        if (rows, 1) in medians and (rows, 2) in medians:
            (c1, p1), (c2, p2) = medians[rows, 1], medians[rows, 2]
            print(f"{rows} rows, one thread to two: one C call {c1 / c2:.2f}x faster, from Python {p1 / p2:.2f}x")


if __name__ == "__main__":
    main()
