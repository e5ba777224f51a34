"""rayrunner's matmul on AMX tiles (`rayrunner.quantization.tile_weights`) against oneDNN's prepacked bf16 matmul,
in process: each of SmolLM2's weight shapes per call (the 30 layers' weights cycled, so each call reads its weight
from memory as a step does), and the fast decode step and a wave's prefill with the model packed either way,
alternating (the model is unpacked and packed again between rounds).

Run:  .venv/bin/python bench/bench_tile_gemm.py [--rows 1 16] [--threads 1] [--rounds 4] [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_decode_step import load
from bench_fused_ops import prefill_ms
from cpu_kind import cpu_line
from profile_step import sequences, timed

from rayrunner.quantization import packed_linear, tile_weights

SHAPES = {"q/k/v": (960, 576), "o": (576, 576), "gate/up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def per_call_us(weights: list[Any], x: torch.Tensor, repeats: int = 5) -> float:
    """Microseconds a call of `x` through each of `weights` in turn, best of a few passes."""
    for weight in weights:
        weight.multiply(x, None)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for weight in weights:
            weight.multiply(x, None)
        best = min(best, (time.perf_counter() - started) / len(weights))
    return best * 1e6


def shapes(rows: list[int], layers: int) -> None:
    print("\n| weight | n x k | rows | oneDNN us | tiles us | tiles GB/s | tiles / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for name, (n, k) in SHAPES.items():
        count = 2 if name == "head" else layers
        plain = [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for _ in range(count)]
        onednn = [packed_linear.OneDnnWeight(weight) for weight in plain]
        tiles = [tile_weights.TileWeight(weight) for weight in plain]
        del plain
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            theirs, ours = per_call_us(onednn, x), per_call_us(tiles, x)
            print(f"| {name} | {n} x {k} | {m} | {theirs:.0f} | {ours:.0f} | {n * k * 2 / ours / 1e3:.1f} | "
                  f"{ours / theirs:.2f}x |")


def gate_up_silu(rows: list[int], layers: int, rounds: int) -> None:
    """SmolLM2's gate/up and SiLU times up per layer: from the tiles' sums (`TileWeight.glu`) against the matmul
    then `silu_mul`, alternating, medians of `rounds`."""
    from rayrunner.engines.transformers.step import fused_ops

    combiner = fused_ops.silu_sums()
    if combiner is None:
        return
    n, k = SHAPES["gate/up"]
    tiles = [tile_weights.TileWeight((torch.randn(n, k) * 0.05).to(torch.bfloat16)) for _ in range(layers)]
    print("\n| gate/up + SiLU, rows | from the sums us | matmul, then silu_mul us | ratio |\n|---|---|---|---|")
    for m in rows:
        x = torch.randn(m, k).to(torch.bfloat16)
        fused, apart = [_Glu(w, combiner) for w in tiles], [_ThenSilu(w) for w in tiles]
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            times[True].append(per_call_us(fused, x))
            times[False].append(per_call_us(apart, x))
        ours, theirs = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {m} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x |")


class _Glu:
    """A tile weight's halves through `glu`, shaped as a weight for `per_call_us`."""

    def __init__(self, weight: tile_weights.TileWeight, combiner: int) -> None:
        self.weight, self.combiner = weight, combiner

    def multiply(self, x: torch.Tensor, bias: None) -> torch.Tensor:
        return self.weight.glu(x, self.combiner)


class _ThenSilu:
    """A tile weight's matmul, then `silu_mul`, shaped as a weight for `per_call_us`."""

    def __init__(self, weight: tile_weights.TileWeight) -> None:
        self.weight = weight

    def multiply(self, x: torch.Tensor, bias: None) -> torch.Tensor:
        from rayrunner.engines.transformers.step import fused_ops

        return fused_ops.silu_mul(self.weight.multiply(x, None), self.weight.n // 2)


def repacked(model: Any, tiles: bool) -> None:
    """`model`'s Linears packed again, for the tiles (`tiles`) or for oneDNN."""
    packed_linear.unpack_linears(model)
    os.environ[tile_weights.SWITCH_ENV] = "1" if tiles else "0"
    tile_weights.library.cache_clear()
    packed_linear.pack_linears(model)


def stepper(model: Any, rows: int, context: int, steps: int) -> Callable[[], float]:
    """Ms a decode step of `rows` rows (the scheduler's step, every row decoding), over `steps` steps a call."""
    scheduler = decoding(model, rows, context, steps)
    return lambda: timed(scheduler, steps)


def decoding(model: Any, rows: int, context: int, steps: int) -> Any:
    """A step scheduler (with the fast step) whose `rows` sequences of `context` tokens are all decoding, with room
    for 100 calls of `steps` steps."""
    from rayrunner.engines.transformers.step.fast_decode import FastDecode
    from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler

    scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=rows))
    scheduler.fast_decode = FastDecode.for_model(model)
    sequences(scheduler, rows, context, 100 * steps, asyncio.new_event_loop())
    while scheduler.stats()["waiting"] or scheduler.stats()["running"] < rows:
        scheduler.step()
    timed(scheduler, 10)
    return scheduler


def alternating(model: Any, rounds: int, measure: Callable[[], float]) -> dict[bool, float]:
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for tiles in (True, False):
            repacked(model, tiles)
            times[tiles].append(measure())
    return {tiles: statistics.median(ms) for tiles, ms in times.items()}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=150)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if tile_weights.library() is None:
        raise SystemExit("the tile kernel is not built here (no AMX, no C compiler, or RAYRUNNER_TILE_GEMM=0)")
    print(cpu_line())
    print(f"torch threads {args.threads}; per call: best of 5 passes over 30 layers' weights (the head's: 2)")
    shapes([*args.rows, 124, 1860], layers=30)
    gate_up_silu([*args.rows, 64, 256, 1620], layers=30, rounds=args.rounds)
    model = load("bf16")
    print(f"\nSmolLM2 bf16, ~{args.context}-token context, medians of {args.rounds} alternating rounds")
    print("| work | tiles ms | oneDNN ms | tiles / oneDNN |\n|---|---|---|---|")
    for rows in args.rows:
        ms = alternating(model, args.rounds, stepper(model, rows, args.context, args.steps))
        print(f"| decode step, {rows} rows | {ms[True]:.1f} | {ms[False]:.1f} | {ms[True] / ms[False]:.2f}x |")
    ms = alternating(model, args.rounds, lambda: prefill_ms(model, 15, 124, 1)[True])
    print(f"| prefill 15 x 124 tokens | {ms[True]:.1f} | {ms[False]:.1f} | {ms[True] / ms[False]:.2f}x |")


if __name__ == "__main__":
    main()
