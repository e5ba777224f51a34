"""rayrunner's int8 kernel (`rayrunner/quantization/int8_rows.c`) against PyTorch's `_weight_int8pack_mm`, in
process, on SmolLM2's Q8_0 weights: one decode step's matmuls (the 30 layers' fused q/k/v, o, fused gate/up and down,
then the vocabulary head, each weight read from memory as a step reads it), per number of rows and of threads, the
two kernels alternating round by round. Prints the weight bytes read per second.

Run:  .venv/bin/python bench/bench_int8_rows.py [--rows 1 4 16] [--threads 1 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from cpu_kind import cpu_line

from rayrunner.quantization import int8_rows

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # a layer's, fused as the decode step fuses them
LAYERS, HEAD = 30, (49152, 576)
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def weights() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A step's int8 weights and scales, random (their speed does not depend on their values)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [*SHAPES * LAYERS, HEAD]
    return [int8_rows.quantize_rows(torch.randn(shape, generator=generator).bfloat16()) for shape in shapes]


def step_ms(kernel: Kernel, model: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> float:
    inputs = {k: torch.randn(rows, k).bfloat16() for k in {q.shape[1] for q, _ in model}}
    start = time.perf_counter()
    for qdata, scale in model:
        kernel(inputs[qdata.shape[1]], qdata, scale)
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if int8_rows.library() is None:
        raise SystemExit("rayrunner's int8 kernel is not built here (it needs AVX-512 BF16 and a C compiler)")
    print(cpu_line())
    model = weights()
    gigabytes = sum(qdata.numel() for qdata, _ in model) / 1e9
    kernels: dict[str, Kernel] = {"rayrunner": int8_rows.few_rows_kernel,
                                  "PyTorch": torch.ops.aten._weight_int8pack_mm}
    print("| threads | rows | rayrunner ms (GB/s) | PyTorch ms (GB/s) | ratio |\n|---|---|---|---|---|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows in args.rows:
            best = {name: step_ms(kernel, model, rows) for name, kernel in kernels.items()}  # the first round warms up
            for _ in range(args.rounds):
                for name, kernel in kernels.items():
                    best[name] = min(best[name], step_ms(kernel, model, rows))
            ours, theirs = best["rayrunner"], best["PyTorch"]
            print(f"| {threads} | {rows} | {ours:.2f} ({gigabytes / ours * 1000:.1f}) | "
                  f"{theirs:.2f} ({gigabytes / theirs * 1000:.1f}) | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
