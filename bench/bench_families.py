"""Head-of-line latency on the step scheduler per architecture family, in process, all in one run.

For each model: an 8-token greedy chat's latency alone, and sent while a long stream (a ~1,500-token prompt, up to
400 output tokens) is decoding; the ratio of their medians over `--reps` rounds (medians taken apart: one round's
spike on this shared machine moves one sample, not a ratio). Within a round the models take turns, so noise hits them
alike. The models, all bf16 on CPU, with SmolLM2's tokenizer:
- `llama`: the builtin SmolLM2-135M-Instruct (Llama family), its real weights;
- `mistral-swa`: SmolLM2's config as a Mistral with `sliding_window` 512, random weights (the fast decode step masks
  the window; the cache keeps every position as plain layers, so the long stream and the short one share a batch);
- `gemma2-mixed` (`--gemma2`): SmolLM2's sizes as a Gemma 2, sliding (512) and full layers alternating, random
  weights (transformers' forward: no fast step).
Each model is served by a `TextEngine` from a folder (the random ones saved to a temporary folder first), with its
compute thread, as a replica serves it. The long stream is cancelled once the short request is answered: what is
measured is the short one's wait while the long one runs. The target: busy / alone <= 3 for every family, as for
Llama over HTTP in `bench_scheduling.py`.

Run:  .venv/bin/python bench/bench_families.py [--reps 5] [--threads 2] [--no-gemma2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from cpu_kind import cpu_line
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from rayrunner.engines.transformers.text import TextEngine
from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.models.spec import build_spec
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest

WINDOW = 512
SHORT = "What is the capital of France?"
PARAGRAPH = ("The lighthouse keeper climbed the spiral stairs each evening, counting the steps, listening to the sea "
             "against the rocks below, and wondering about the ships that passed far out in the dark. ")
TARGET = 3.0


def random_folder(base: Path, name: str, model_type: str, **settings: Any) -> str:
    """SmolLM2's sizes as `model_type`, random bf16 weights, saved with SmolLM2's tokenizer; the folder."""
    smol = AutoConfig.from_pretrained(resolve(SMOLLM2).path)
    sizes = {key: getattr(smol, key) for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads", "num_key_value_heads", "head_dim",
                                                "max_position_embeddings", "bos_token_id", "eos_token_id",
                                                "pad_token_id", "tie_word_embeddings")}
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**sizes, **settings})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    folder = base / name
    model.save_pretrained(str(folder))
    AutoTokenizer.from_pretrained(resolve(SMOLLM2).path).save_pretrained(str(folder))
    return str(folder)


class Served:
    """One model on a `TextEngine` in this process."""

    def __init__(self, name: str, source: str, threads: int) -> None:
        self.name = name
        self.engine = TextEngine(build_spec(name, {"type": "plain", "model_id": source}, None,
                                            {"torch_threads": threads}))
        self.long_prompt = PARAGRAPH * 40  # ~1,500 tokens with SmolLM2's tokenizer
        self.prompt_tokens = len(self.engine.tokenizer(self.long_prompt)["input_ids"])

    async def short(self) -> float:
        """Seconds to answer an 8-token greedy chat (EOS ignored: always 8 tokens)."""
        request = ChatCompletionRequest(messages=[{"role": "user", "content": SHORT}])
        start = time.perf_counter()
        tokens = [e async for e in self.engine.chat(request, SamplingParams(max_tokens=8, ignore_eos=True))]
        assert tokens[-1].completion_tokens == 8, tokens[-1]
        return time.perf_counter() - start

    async def during_long(self) -> tuple[float, int]:
        """The short request's seconds while the long stream decodes, and how many tokens the long one had out
        when the short one was sent."""
        stream = self.engine.complete(CompletionRequest(prompt=self.long_prompt),
                                      SamplingParams(max_tokens=400, ignore_eos=True))
        out = 0
        first = asyncio.Event()

        async def drain() -> None:
            nonlocal out
            async for _ in stream:
                out += 1
                first.set()

        task = asyncio.ensure_future(drain())
        await first.wait()  # prefilled: the long one is decoding
        await asyncio.sleep(0.3)
        sent_at = out
        try:
            return await self.short(), sent_at
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await stream.aclose()  # type: ignore[attr-defined]
            while self.engine.scheduler.stats()["running"]:
                await asyncio.sleep(0.05)

    def info(self) -> str:
        fast = self.engine.scheduler.fast_decode is not None
        return f"{self.engine.model.config.model_type}, fast decode step: {'yes' if fast else 'no'}"


async def measure(models: list[Served], reps: int) -> dict[str, dict[str, list[float]]]:
    rows: dict[str, dict[str, list[float]]] = {m.name: {"alone": [], "busy": []} for m in models}
    for model in models:  # warm-up
        await model.short()
    for _ in range(reps):
        for model in models:
            alone = await model.short()
            busy, _ = await model.during_long()
            rows[model.name]["alone"].append(alone)
            rows[model.name]["busy"].append(busy)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the engines' torch threads")
    parser.add_argument("--gemma2", action=argparse.BooleanOptionalAction, default=True,
                        help="also a Gemma 2-style mixed sliding/full model")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="rayrunner-families-") as base:
        sources = {"llama": SMOLLM2,
                   "mistral-swa": random_folder(Path(base), "mistral", "mistral", sliding_window=WINDOW)}
        if args.gemma2:
            sources["gemma2-mixed"] = random_folder(Path(base), "gemma2", "gemma2", sliding_window=WINDOW,
                                                    query_pre_attn_scalar=64)
        models = [Served(name, source, args.threads) for name, source in sources.items()]
        try:
            rows = asyncio.run(measure(models, args.reps))
        finally:
            for model in models:
                model.engine.close()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"\n{cpu_line()}\nbf16, CPU, {args.threads} torch threads, long prompt {models[0].prompt_tokens} tokens, "
          f"median of {args.reps}")
    print(f"{'model':<14}{'alone s':>9}{'busy s':>9}{'busy/alone':>12}  target <= {TARGET}   (family; per round)")
    summary = []
    for model in models:
        alone, busy = (statistics.median(rows[model.name][key]) for key in ("alone", "busy"))
        ratio = busy / alone
        rounds = [b / a for a, b in zip(rows[model.name]["alone"], rows[model.name]["busy"], strict=True)]
        print(f"{model.name:<14}{alone:>9.2f}{busy:>9.2f}{ratio:>12.2f}  {'met' if ratio <= TARGET else 'NOT met':<14}"
              f"({model.info()}; rounds {min(rounds):.2f}-{max(rounds):.2f})")
        summary.append(f"{model.name}={ratio:.2f}")
    print("SUMMARY: head-of-line busy/alone " + " ".join(summary))


if __name__ == "__main__":
    main()
