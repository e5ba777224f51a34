"""Decode steps in process: rayrunner's fast step (`rayrunner.engines.transformers.step.fast_decode`) against
transformers' forward on the same model and the same kind of `BatchCache`, per ISQ level and batch shape,
alternating the two sides.

Each case prefills `rows` sequences of `context` random tokens through transformers' forward (the same for both
sides), then times `--steps` greedy decode steps: transformers' forward (its cache appends by concatenating) or
`FastDecode.step` (appends into reserved room). Figures are decode tok/s over all rows, medians of `--rounds`; the
ratio is fast / transformers.

Run: `.venv/bin/python bench/bench_decode_step.py [--levels bf16 Q8_0] [--shapes 1x40 16x100 16x1000] [--rounds 3]`
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from cpu_kind import cpu_line


def load(level: str) -> Any:
    """The builtin SmolLM2 loaded (and quantized) as a replica loads it, on this thread."""
    from transformers import AutoModelForCausalLM

    from rayrunner.engines.loading import load_model
    from rayrunner.models.sources import SMOLLM2
    from rayrunner.models.spec import build_spec

    spec = build_spec(f"smollm2-{level}", {"type": "plain", "model_id": SMOLLM2},
                      in_situ_quant=None if level == "bf16" else level)
    return load_model(spec, AutoModelForCausalLM).model


@torch.inference_mode()
def decode_rate(model: Any, fast: Any, rows: int, context: int, steps: int) -> float:
    """Tok/s of `steps` greedy decode steps over `rows` sequences of `context` tokens (`fast`: None for
    transformers' forward)."""
    from rayrunner.engines.transformers.kv.kv_batch import BatchCache, new_cache

    batch = BatchCache(new_cache(model.config), torch.zeros((rows, 0), dtype=torch.long))
    prompt = torch.randint(0, 1000, (rows, context), generator=torch.Generator().manual_seed(0))
    mask = batch.mask_with(context)
    logits = model(input_ids=prompt, attention_mask=mask, position_ids=torch.arange(context).repeat(rows, 1),
                   cache=batch.cache, logits_to_keep=1).logits
    batch.grew(mask)
    ids = logits[:, -1].argmax(-1, keepdim=True)
    start = time.perf_counter()
    for _ in range(steps):
        if fast is None:
            mask = batch.mask_with(1)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=batch.next_positions(),
                           cache=batch.cache, logits_to_keep=1).logits
            batch.grew(mask)
        else:
            logits = fast.step(ids, batch)
        ids = logits[:, -1].argmax(-1, keepdim=True)
    return rows * steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", nargs="+", default=["bf16", "Q8_0"], help="bf16 and/or ISQ names")
    parser.add_argument("--shapes", nargs="+", default=["1x40", "16x100", "16x1000"], help="ROWSxCONTEXT")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="measurements per side and case")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from rayrunner.engines.transformers.step.fast_decode import FastDecode

    print(cpu_line())
    print(f"SmolLM2, CPU, {torch.get_num_threads()} torch threads, {args.steps} steps, median of {args.rounds}")
    print(f"{'level':6} {'rows x context':>14} {'transformers':>12} {'fast step':>10} {'ratio':>6}")
    for level in args.levels:
        model = load(level)
        fast = FastDecode.for_model(model)
        assert fast is not None, "SmolLM2 is a Llama: the fast step covers it"
        for warm_up in (None, fast):  # first calls pay one-off costs (allocator, kernels' first use)
            decode_rate(model, warm_up, 2, 8, 4)
        for shape in args.shapes:
            rows, context = (int(part) for part in shape.split("x"))
            sides: dict[str, list[float]] = {"transformers": [], "fast": []}
            for _ in range(args.rounds):
                sides["transformers"].append(decode_rate(model, None, rows, context, args.steps))
                sides["fast"].append(decode_rate(model, fast, rows, context, args.steps))
            theirs, ours = (statistics.median(sides[side]) for side in ("transformers", "fast"))
            print(f"{level:6} {shape:>14} {theirs:12.1f} {ours:10.1f} {ours / theirs:5.2f}x")


if __name__ == "__main__":
    main()
