"""Single-stream decode speed of rayrunner's in-process engine against mistral.rs, per ISQ level, on SmolLM2.

Run: `python bench/bench_vs_mistralrs.py --mistralrs-python /tmp/mrs/bin/python` after
`python3 -m venv /tmp/mrs && /tmp/mrs/bin/pip install mistralrs==0.9.5` (a side venv: never install it into
rayrunner's).
Without a python that imports mistralrs, only rayrunner's side runs, with a message saying so.

Both sides load the same weights, rayrunner's builtin bf16 SmolLM2 (`smollm2-135m-instruct`), and quantize them in
situ to the same level name. rayrunner runs `TextEngine.chat`, so the step scheduler is what is measured; mistral.rs
runs as a worker subprocess of the side venv's python, holding one `Runner` per level, and answers one request per
line of stdin (on a stdout line marked `@@`). Level by level, requests alternate between the two sides round
by round, so both see the same machine load (rayrunner holds one level's engine at a time, as a replica does).
Every request is the same greedy chat of `--tokens` tokens.

Figures: decode tok/s is completion tokens over the completion time each engine reports (`usage` in mistral.rs);
wall tok/s is completion tokens over the whole request as the caller saw it. The table shows medians.
mistral.rs reads `rope_theta` at the top of config.json, where transformers 5 writes `rope_parameters`, so its side
loads a temporary folder of links to the builtin's files with that key added.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cpu_kind import cpu_line

PROMPT = "Tell me about the history of Paris."
FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
         "chat_template.jinja")

WORKER = r"""
import json, sys, time
from mistralrs import ChatCompletionRequest, ModelDType, Runner, Which
folder, levels = sys.argv[1], sys.argv[2].split(",")
runners = {level: Runner(which=Which.Plain(model_id=folder, dtype=ModelDType.BF16),
                         in_situ_quant=None if level == "bf16" else level) for level in levels}
print("@@", json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    request = ChatCompletionRequest(model="default", messages=[{"role": "user", "content": ask["prompt"]}],
                                    max_tokens=ask["tokens"], temperature=0.0)
    start = time.perf_counter()
    reply = runners[ask["level"]].send_chat_completion_request(request)
    wall = time.perf_counter() - start
    usage = reply.usage
    print("@@", json.dumps({"tokens": usage.completion_tokens, "decode_s": usage.total_completion_time_sec,
                      "wall_s": wall, "text": reply.choices[0].message.content}), flush=True)
"""


class MistralRs:
    """The mistral.rs worker: one subprocess of the side venv's python, one request per line."""

    def __init__(self, python: str, folder: Path, levels: list[str]) -> None:
        self.log = folder / "mistralrs.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen([python, "-c", WORKER, str(folder), ",".join(levels)], text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        if self._read().get("ready") is not True:
            raise RuntimeError("the mistral.rs worker did not start")

    def run(self, level: str, tokens: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"level": level, "tokens": tokens, "prompt": PROMPT}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # mistral.rs prints too: answers are the lines marked "@@"
            if line.startswith("@@ "):
                result: dict[str, Any] = json.loads(line[3:])
                return result
        tail = self.log.read_text().splitlines()[-5:]
        raise RuntimeError(f"the mistral.rs worker exited (code {self.process.wait()}): {tail}")

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(timeout=60)


def mistralrs_usable(python: str | None) -> str | None:
    """Why the mistral.rs side cannot run, or None when it can."""
    if python is None:
        return "no --mistralrs-python given"
    try:
        found = subprocess.run([python, "-c", "import mistralrs"], capture_output=True, timeout=120)
    except OSError as exc:
        return f"{python} cannot run: {exc}"
    return None if found.returncode == 0 else f"{python} cannot import mistralrs"


def mistralrs_folder(builtin: Path, target: Path) -> Path:
    """Links to the builtin's files, with the `rope_theta` key mistral.rs reads added to config.json."""
    config = json.loads((builtin / "config.json").read_text())
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    (target / "config.json").write_text(json.dumps(config, indent=1))
    for name in FILES:
        if (builtin / name).exists():
            (target / name).symlink_to(builtin / name)
    return target


class Rayrunner:
    """rayrunner's engine for one level at a time (each engine has a compute thread, and two at once in one process
    slow each other down: see `rayrunner.engines.transformers.step.compute_thread`), driven on one event loop."""

    def __init__(self) -> None:
        self.level: str | None = None
        self.engine: Any = None
        self.loop = asyncio.new_event_loop()

    def run(self, level: str, tokens: int) -> dict[str, Any]:
        if level != self.level:
            self._load(level)
        return self.loop.run_until_complete(self._chat(tokens))

    def _load(self, level: str) -> None:
        from rayrunner.engines.transformers.text import TextEngine
        from rayrunner.models.sources import SMOLLM2
        from rayrunner.models.spec import build_spec

        if self.engine is not None:
            self.engine.close()
        which = {"type": "plain", "model_id": SMOLLM2}
        self.engine = TextEngine(build_spec(f"smollm2-{level}", which,
                                            in_situ_quant=None if level == "bf16" else level))
        self.level = level

    async def _chat(self, tokens: int) -> dict[str, Any]:
        from rayrunner.openai.sampling_params import SamplingParams
        from rayrunner.protocol import ChatCompletionRequest

        request = ChatCompletionRequest(messages=[{"role": "user", "content": PROMPT}])
        start = time.perf_counter()
        text, last = "", None
        async for event in self.engine.chat(request, SamplingParams(max_tokens=tokens)):
            text, last = text + event.text, event
        wall = time.perf_counter() - start
        assert last is not None
        return {"tokens": last.completion_tokens, "decode_s": last.completion_time_s, "wall_s": wall, "text": text}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.loop.close()


def rates(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """Median decode and wall tok/s of `runs`."""
    decode = statistics.median(run["tokens"] / run["decode_s"] for run in runs)
    wall = statistics.median(run["tokens"] / run["wall_s"] for run in runs)
    return decode, wall


def print_table(levels: list[str], results: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    print(f"{'level':6} {'rayrunner decode':>16} {'mistral.rs decode':>17} {'ratio':>6} "
          f"{'rayrunner wall':>14} {'mistral.rs wall':>15} {'ratio':>6}")
    for level in levels:
        ours = rates(results["rayrunner"][level])
        theirs = rates(results["mistral.rs"][level]) if results["mistral.rs"].get(level) else None
        line = f"{level:6} {ours[0]:16.1f} "
        if theirs is None:
            line += f"{'-':>17} {'-':>6} {ours[1]:14.1f} {'-':>15} {'-':>6}"
        else:
            line += (f"{theirs[0]:17.1f} {ours[0] / theirs[0]:5.2f}x {ours[1]:14.1f} {theirs[1]:15.1f} "
                     f"{ours[1] / theirs[1]:5.2f}x")
        print(line)
    for side, by_level in results.items():
        for level, runs in by_level.items():
            print(f"{side} {level} ({runs[0]['tokens']} tokens): {runs[0]['text'][:70]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mistralrs-python", help="python of a venv where mistralrs is installed")
    parser.add_argument("--levels", nargs="+", default=["bf16", "Q8_0", "Q4K"], help="bf16 and/or ISQ names")
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per request")
    parser.add_argument("--rounds", type=int, default=5, help="requests per level and side (plus one warm-up)")
    args = parser.parse_args()

    from rayrunner.models.sources import SMOLLM2, resolve

    builtin = Path(resolve(SMOLLM2).path)
    why_not = mistralrs_usable(args.mistralrs_python)
    if why_not is not None:
        print(f"mistral.rs side skipped: {why_not}. Install it in a side venv: python3 -m venv /tmp/mrs && "
              "/tmp/mrs/bin/pip install mistralrs==0.9.5; then pass --mistralrs-python /tmp/mrs/bin/python",
              file=sys.stderr)
    with tempfile.TemporaryDirectory() as scratch:
        sides: dict[str, Any] = {"rayrunner": Rayrunner()}
        if why_not is None:
            sides["mistral.rs"] = MistralRs(args.mistralrs_python, mistralrs_folder(builtin, Path(scratch)),
                                            args.levels)
        results: dict[str, dict[str, list[dict[str, Any]]]] = {"rayrunner": {}, "mistral.rs": {}}
        try:
            for level in args.levels:
                for round_ in range(args.rounds + 1):
                    for name, side in sides.items():
                        run = side.run(level, args.tokens)
                        if round_:  # round 0 warms both sides up
                            results[name].setdefault(level, []).append(run)
        finally:
            for side in sides.values():
                side.close()
    print(cpu_line())
    print(f"SmolLM2-135M-Instruct, CPU, single stream, {args.tokens} greedy tokens, median of {args.rounds}")
    print_table(args.levels, results)


if __name__ == "__main__":
    main()
