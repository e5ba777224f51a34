"""Prefill of SmolLM2 in process: half-precision matmuls against float32 ones
(`rayrunner.quantization.cpu_gemm`), same model.

On CPUs without a native bf16 GEMM, rayrunner runs a prompt's many-row matmuls in float32 (`WideLinear` for plain
Linears, the int8 conversion path for Q8_0). This measures a prompt's prefill both ways, alternating, per ISQ level:
transformers' forward over `rows` prompts of `tokens` tokens, `logits_to_keep=1` as the engine calls it. On a CPU
with a native bf16 GEMM both sides run the same kernels (the ratio is then ~1, as it should be).

    .venv/bin/python bench/bench_prefill.py [--levels bf16 Q8_0] [--shapes 1x40 1x400 8x100]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from bench_decode_step import load
from cpu_kind import cpu_line

from rayrunner.quantization import cpu_gemm
from rayrunner.quantization.cpu_gemm import WideLinear, native_half_gemm


@contextmanager
def half_precision(model: Any) -> Iterator[None]:
    """Within: the model's matmuls in its own dtype (what PyTorch does without rayrunner's widening)."""
    wide = [module for module in model.modules() if type(module) is WideLinear]
    for module in wide:
        module.__class__ = torch.nn.Linear
    native = cpu_gemm.native_half_gemm
    cpu_gemm.native_half_gemm = lambda dtype: True  # type: ignore[assignment]  # the int8 conversion path too
    try:
        yield
    finally:
        cpu_gemm.native_half_gemm = native  # type: ignore[assignment]
        for module in wide:
            module.__class__ = WideLinear


@torch.inference_mode()
def prefill_seconds(model: Any, rows: int, tokens: int) -> float:
    ids = torch.randint(0, 1000, (rows, tokens), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    model(input_ids=ids, logits_to_keep=1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="+", default=["bf16", "Q8_0"], help="bf16 and/or ISQ names")
    parser.add_argument("--shapes", nargs="+", default=["1x40", "1x400", "8x100"], help="ROWSxTOKENS")
    parser.add_argument("--rounds", type=int, default=5, help="measurements per side and case (median shown)")
    args = parser.parse_args()
    print(f"{cpu_line()}\nSmolLM2 prefill, CPU ({torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM: "
          f"{native_half_gemm(torch.bfloat16)}), {torch.get_num_threads()} threads, median of {args.rounds} (ms)")
    print(f"{'level':6} {'rows x tokens':>13} {'half':>8} {'float32':>8} {'ratio':>6}")
    for level in args.levels:
        model = load(level)
        for shape in args.shapes:
            rows, tokens = (int(part) for part in shape.split("x"))
            half, wide = [], []
            for _ in range(args.rounds + 1):  # the first pair is a warm-up
                with half_precision(model):
                    half.append(prefill_seconds(model, rows, tokens))
                wide.append(prefill_seconds(model, rows, tokens))
            h, w = statistics.median(half[1:]), statistics.median(wide[1:])
            print(f"{level:6} {shape:>13} {h * 1e3:8.1f} {w * 1e3:8.1f} {h / w:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
