"""One client switching between models with room for one, over HTTP: the first token of a model never loaded, and
of a model coming back after its eviction, with eviction to sleep (`evict_mode: sleep`, rayrunner's default) and
to stop (`evict_mode: stop`, what llama-swap and Ollama do), side by side in one run.

Three models with room for one (`max_loaded_models: 1`): the builtin SmolLM2 at bf16, loaded when the service
starts (as `serve_config.yaml`'s default model is), and two in-situ quantized copies (Q8_0, Q4K) never loaded
before. The client asks each in turn, one streamed 8-token chat at a time: the first lap's first tokens of the two
copies are cold loads, the next `--laps` laps' are returns after an eviction. Figures: first-token seconds per
request, the medians of cold and returning, their ratio, and the CPU's kind.

Run:  .venv/bin/python bench/bench_switching.py [--laps 3] [--modes sleep,stop]
It starts its own local Ray cluster per mode (ports in 30000-32000) and shuts it down at the end.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import httpx
from bench_many_models import cpu_kind
from rayrunner_service import smollm2_spec, wait_loaded

SPECS = [smollm2_spec("smol-bf16"), smollm2_spec("smol-q8_0", "Q8_0"), smollm2_spec("smol-q4k", "Q4K")]


def first_token_s(http: httpx.Client, model: str) -> float:
    body = {"model": model, "stream": True, "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    sent = time.monotonic()
    first = None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.monotonic() - sent
    if first is None:
        raise RuntimeError(f"{model}: no content streamed")
    return first


def run_mode(mode: str, laps: int, settle_s: float) -> dict[str, Any]:
    import ray
    from bench_cluster import start_cluster
    from ray import serve

    from rayrunner.router.app import build_router_app

    base = start_cluster()
    try:
        with tempfile.TemporaryDirectory(prefix="rayrunner-switch-") as state_dir, \
                httpx.Client(base_url=base, timeout=900) as http:
            config = {"models": [{"spec": spec, "load": i == 0} for i, spec in enumerate(SPECS)],
                      "max_loaded_models": 1, "evict_mode": mode, "state_path": f"{state_dir}/registry.json"}
            serve.run(build_router_app(config), name="rayrunner", route_prefix="/",
                      logging_config={"enable_access_log": False})
            ids = [spec["model_id"] for spec in SPECS]
            wait_loaded(http, ids[0])
            time.sleep(settle_s)  # the service is up: its spare worker imports meanwhile
            cold, back = [], []
            for lap in range(laps + 1):
                for model in ids:
                    seconds = first_token_s(http, model)
                    if lap > 0:
                        back.append(seconds)
                    elif model != ids[0]:  # the first lap's default model was loaded at start: neither
                        cold.append(seconds)
                    print(f"  {mode:<5} lap {lap} {model:<10} first token {seconds:.2f} s", flush=True)
                    time.sleep(settle_s)  # a user's think time; the spare worker a load leaves imports meanwhile
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"mode": mode, "cold": statistics.median(cold), "back": statistics.median(back),
            "back_max": max(back)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--laps", type=int, default=3)
    parser.add_argument("--modes", type=lambda v: v.split(","), default=["sleep", "stop"])
    parser.add_argument("--settle", type=float, default=5.0)
    args = parser.parse_args()
    print(f"CPU: {cpu_kind()}; 3 models, room for 1, {args.laps} laps after the cold one")
    for row in [run_mode(mode, args.laps, args.settle) for mode in args.modes]:
        print(f"evict_mode {row['mode']:<5}: cold first token {row['cold']:.2f} s (median), back after eviction "
              f"{row['back']:.2f} s (median, max {row['back_max']:.2f}): {row['back'] / row['cold']:.2f}x cold")


if __name__ == "__main__":
    main()
