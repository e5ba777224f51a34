"""A prompt fed beside the decode step (one forward: vLLM's mixed batch) against a forward of its own before the
decode step (what the step scheduler did before), in process.

The load of `bench_turnover.py`: `--streams` sequences of SmolLM2 through the step scheduler (fast decode step and
prefix cache as a replica runs them), each a ~124-token prompt whose first 32 tokens all share and `--max-tokens`
tokens with `ignore_eos`, a finished one replaced at once, so prompts arrive one at a time while the others decode.
Output tok/s over `--steps` steps, the two sides alternating for `--rounds` rounds in one process; the median of
each and their ratio.

Run: `.venv/bin/python bench/bench_mixed_step.py [--threads 1] [--streams 16] [--rounds 3] [--steps 300]`
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from bench_decode_step import load
from bench_turnover import add_arguments, compare

from rayrunner.engines.transformers.step.model_runner import ModelRunner


@contextmanager
def prompts_alone() -> Iterator[None]:
    """Every prompt prefilled in a forward of its own (mixing off)."""
    mixes = ModelRunner.mixes
    ModelRunner.mixes = lambda self, sequence: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        ModelRunner.mixes = mixes  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", default="bf16", help="bf16 or an ISQ level")
    add_arguments(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sides: dict[str, Callable[[], Any]] = {"prompt in its own forward": prompts_alone,
                                           "prompt beside the decode": nullcontext}
    medians = compare(load(args.level), args, sides, args.level)
    ratio = medians["prompt beside the decode"] / medians["prompt in its own forward"]
    print(f"SUMMARY: beside / own forward {ratio:.3f}x")

if __name__ == "__main__":
    main()
