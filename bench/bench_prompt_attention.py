"""rayrunner's prompt attention on AMX tiles (`rayrunner.engines.transformers.step.prompt_attention`) against
PyTorch's flash SDPA, in process, on the builtin SmolLM2: a wave of prompts prefilled together through the fast step
with the kernel and without (alternating), and one prompt's attention per call (SmolLM2's 9 query and 3 KV heads of
64).

Run:  .venv/bin/python bench/bench_prompt_attention.py [--prompts 15] [--prompt-tokens 124] [--rounds 4] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from bench_decode_step import load
from bench_fused_ops import per_call_us, prefill_ms
from cpu_kind import cpu_line

from rayrunner.engines.transformers.step import prompt_attention


@contextmanager
def tiles_or_sdpa(tiles: bool) -> Iterator[None]:
    """Prompts' attention on the tiles (`tiles`) or through SDPA, within the block."""
    attends = prompt_attention.attends
    if not tiles:
        prompt_attention.attends = lambda query, heads, kv_heads, head_dim, positions: False  # type: ignore[assignment]
    try:
        yield
    finally:
        prompt_attention.attends = attends  # type: ignore[assignment]


def per_call(tokens: int) -> tuple[float, float]:
    """Microseconds of one prompt's attention, the kernel and SDPA (as `PromptChunk.attend` calls it)."""
    heads, kv_heads, dim = 9, 3, 64
    rotated = torch.randn(tokens, heads + kv_heads, dim).to(torch.bfloat16)
    keys, values = (torch.randn(kv_heads, tokens, dim).to(torch.bfloat16) for _ in range(2))
    query = rotated[:, :heads]

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(query.transpose(0, 1)[None], keys[None], values[None], is_causal=True,
                                             scale=dim ** -0.5, enable_gqa=True)
        return out[0].transpose(0, 1).reshape(tokens, -1)

    return (per_call_us(lambda: prompt_attention.prompt_attention(query, keys, values, 0, dim ** -0.5)),
            per_call_us(sdpa))


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=15)
    parser.add_argument("--prompt-tokens", type=int, default=124)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ[prompt_attention.SWITCH_ENV] = "1"  # measured whatever the environment says
    prompt_attention.library.cache_clear()
    if prompt_attention.library() is None:
        raise SystemExit("the prompt attention is not built here (no AMX tiles, or no C compiler)")
    print(cpu_line())
    model = load("bf16")
    wave = prefill_ms(model, args.prompts, args.prompt_tokens, args.rounds, tiles_or_sdpa)
    ours, theirs = per_call(args.prompt_tokens)
    print(f"SmolLM2 bf16, {args.threads} thread(s), medians of {args.rounds} rounds\n")
    print("| work | tiles | SDPA | tiles / SDPA |\n|---|---|---|---|")
    print(f"| {args.prompts} prompts of {args.prompt_tokens} tokens prefilled together (ms) | {wave[True]:.1f} | "
          f"{wave[False]:.1f} | {wave[True] / wave[False]:.2f}x |")
    print(f"| one prompt's attention, one layer (us) | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")


if __name__ == "__main__":
    main()
