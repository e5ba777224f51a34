"""The fast decode step with its fused bf16 operations (`rayrunner.engines.transformers.step.fused_ops`) against the
same step with PyTorch's operations, in process, alternating, on the builtin SmolLM2: decode steps, and a wave of
prompts prefilled together; and each fused operation against the PyTorch operations it replaces, per call.

Run:  .venv/bin/python bench/bench_fused_ops.py [--rows 1 16] [--context 150] [--steps 30] [--rounds 4] [--threads 1]
                                               [--prompts 15] [--prompt-tokens 124]

The step is the scheduler's, as `profile_step.py` drives it (every row decoding, `--context` tokens of prompt);
each round times `--steps` steps with the fused operations and `--steps` without, on the same batch (its context
grows by both). Figures: ms a step, the median of the rounds, and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from bench_decode_step import load
from cpu_kind import cpu_line
from profile_step import sequences, timed

from rayrunner.engines.transformers.step import decode_attention, fast_decode, fused_ops


@contextmanager
def fused_or_not(fused: bool) -> Iterator[None]:
    """The fast step with its fused operations and decode attention (`fused`), or with PyTorch's operations and
    SDPA, within the block."""
    built, attends = fused_ops.applies, decode_attention.attends
    if not fused:
        fused_ops.applies = lambda hidden: False  # type: ignore[assignment]
        decode_attention.attends = lambda hidden, group, head_dim: False  # type: ignore[assignment]
    try:
        yield
    finally:
        fused_ops.applies, decode_attention.attends = built, attends  # type: ignore[assignment]


def step_ms(model: Any, rows: int, context: int, steps: int, rounds: int) -> dict[bool, float]:
    """Median ms a decode step of `rows` rows, with the fused operations (True) and without (False)."""
    from rayrunner.engines.transformers.step.scheduler import SchedulerLimits, StepScheduler

    scheduler = StepScheduler(model, SchedulerLimits(max_num_seqs=rows))
    scheduler.fast_decode = fast_decode.FastDecode.for_model(model)
    loop = asyncio.new_event_loop()
    sequences(scheduler, rows, context, 2 * steps * rounds + 10, loop)
    while scheduler.stats()["waiting"] or scheduler.stats()["running"] < rows:
        scheduler.step()
    timed(scheduler, 10)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for fused in (True, False):
            with fused_or_not(fused):
                times[fused].append(timed(scheduler, steps))
    return {fused: statistics.median(ms) for fused, ms in times.items()}


def prefill_ms(model: Any, prompts: int, tokens: int, rounds: int,
               switch: Callable[[bool], AbstractContextManager[None]] = fused_or_not) -> dict[bool, float]:
    """Median ms to prefill `prompts` prompts of `tokens` tokens at once through the fast step (as prompts
    prefilled aside or fed beside a decode step are), with what `switch` turns on (True) and without (False),
    alternating."""
    from rayrunner.engines.transformers.kv.kv_batch import BatchCache, new_cache

    fast = fast_decode.FastDecode.for_model(model)
    assert fast is not None
    heads = model.config.num_attention_heads

    def chunks() -> list[fast_decode.PromptChunk]:
        return [fast_decode.PromptChunk([(37 * t + 11 * i) % 4000 + 10 for t in range(tokens)], 0,
                                        BatchCache(new_cache(model.config), torch.zeros((1, 0), dtype=torch.long)),
                                        heads) for i in range(prompts)]

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds + 1):  # the first round warms up
        for fused in (True, False):
            with switch(fused):
                started = time.perf_counter()
                fast.prefill(chunks())
                times[fused].append((time.perf_counter() - started) * 1000)
    return {fused: statistics.median(ms[1:]) for fused, ms in times.items()}


def per_call_us(fn: Callable[[], Any], calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls * 1e6


def operations(rows: int, model: Any, context: int) -> list[tuple[str, float, float]]:
    """(operation, us a call fused, us a call with PyTorch's operations) at `rows` rows of the model's shapes; the
    decode attention (against the flash SDPA it replaces) over `context` positions, the layers' caches cycled so
    that each call reads its keys and values from memory, as a step does."""
    config = model.config
    width, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    dim = width // heads
    norm = model.model.layers[0].post_attention_layernorm
    hidden = torch.randn(rows, width).to(torch.bfloat16)
    addend = torch.randn(rows, width).to(torch.bfloat16) * 0
    qkv = torch.randn(rows, heads + 2 * kv_heads, dim).to(torch.bfloat16)
    cos, sin = torch.randn(rows, 1, dim).to(torch.bfloat16), torch.randn(rows, 1, dim).to(torch.bfloat16)

    intermediate = config.intermediate_size
    gate_up = torch.randn(rows, 2 * intermediate).to(torch.bfloat16)

    def silu_mul_eager() -> torch.Tensor:
        gate, up = gate_up.split(intermediate, dim=-1)
        return torch.nn.functional.silu(gate).mul_(up)

    def add_norm_eager() -> torch.Tensor:
        hidden.add_(addend)
        return fast_decode._rms_norm(norm, hidden)

    timed = [
        ("residual add + RMSNorm", per_call_us(lambda: fused_ops.add_rms_norm(hidden, addend, norm.weight,
                                                                             norm.variance_epsilon)),
         per_call_us(add_norm_eager)),
        ("RoPE (query and key heads)", per_call_us(lambda: fused_ops.rope(qkv, heads + kv_heads, cos, sin)),
         per_call_us(lambda: fast_decode._rope(qkv, heads + kv_heads, cos, sin, fused=False))),
        ("SiLU(gate) * up", per_call_us(lambda: fused_ops.silu_mul(gate_up, intermediate)),
         per_call_us(lambda: silu_mul_eager())),
    ]
    if rows > 64 or not decode_attention.attends(hidden, heads // kv_heads, dim):
        return timed
    query = qkv[:, :heads].view(rows, kv_heads, heads // kv_heads, dim)
    rooms = [torch.randn(2, rows, kv_heads, context + 20, dim).to(torch.bfloat16)
             for _ in range(config.num_hidden_layers)]
    bias = torch.zeros(rows, 1, 1, context)
    layers = itertools.cycle(rooms)

    def attend(kernel: Callable[..., torch.Tensor]) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            room = next(layers)
            return kernel(query, room[0, :, :, :context], room[1, :, :, :context], bias, dim ** -0.5)
        return call

    timed.append((f"decode attention over {context} positions (flash SDPA)",
                  per_call_us(attend(decode_attention.decode_attention), calls=600),
                  per_call_us(attend(fast_decode._flash_attention), calls=600)))
    return timed


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--prompts", type=int, default=15, help="prompts prefilled together")
    parser.add_argument("--prompt-tokens", type=int, default=124)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if fused_ops.library() is None:
        raise SystemExit("the fused operations are not built here (no C compiler, or RAYRUNNER_FUSED_OPS=0)")
    model = load("bf16")
    print(cpu_line())
    print(f"SmolLM2 bf16, torch threads {args.threads}, ~{args.context}-token context, medians of {args.rounds} "
          f"alternating rounds of {args.steps} steps")
    print("| work | fused ms | PyTorch's ops ms | fused / PyTorch's |\n|---|---|---|---|")
    for rows in args.rows:
        ms = step_ms(model, rows, args.context, args.steps, args.rounds)
        print(f"| decode step, {rows} rows | {ms[True]:.1f} | {ms[False]:.1f} | {ms[True] / ms[False]:.2f}x |")
    ms = prefill_ms(model, args.prompts, args.prompt_tokens, args.rounds)
    print(f"| prefill {args.prompts} x {args.prompt_tokens} tokens | {ms[True]:.1f} | {ms[False]:.1f} | "
          f"{ms[True] / ms[False]:.2f}x |")
    print("\n| operation | rows | fused us a call | PyTorch's ops us a call |\n|---|---|---|---|")
    for rows in (*args.rows, 1860):
        for name, fused, eager in operations(rows, model, args.context):
            print(f"| {name} | {rows} | {fused:.1f} | {eager:.1f} |")


if __name__ == "__main__":
    main()
