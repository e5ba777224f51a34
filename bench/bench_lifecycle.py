"""Lifecycle cost of rayrunner on the builtin SmolLM2 (smollm2-135m-instruct), measured side by side in one run.

Through the router's admin HTTP API (`POST /v1/models/unload` and `POST /v1/models/reload`, body `{"model_id": ...}`;
both answer once the replica is gone / running) it times unload and reload for a few cycles, and after each cycle
the bare in-process `AutoModelForCausalLM.from_pretrained(<same folder>, dtype=bf16)` of the same cache, memory-mapped
as the replica loads it (and read into memory, `disable_mmap=True`, as rayrunner loaded before), so machine noise hits
both alike. Reported: medians, reload / bare load, and the cold reload to first answer (the one-token chat after a
`stop`, its auto-reload included) / bare load. The replica's own `load_time_s`
(weights + tokenizer + ISQ, from `ModelServer.info`) splits reload into "Serve + process start + imports" and "load".
After each cycle it also times the first answer after an unload by `stop` and after one by `sleep` (the replica
process stays, its weights freed): the auto-reload or the wake is what differs.
With `--isq Q8_0` a second model with `in_situ_quant: Q8_0` is measured the same way, against bare load + quantize
(skipped with a message when `rayrunner.quantization.quantize_model` is missing or not implemented).
With `--floor` a tiny random-weight Llama (2 layers, SmolLM2's tokenizer; `tests/tiny_models.py`) is measured the
same way: its load is next to nothing, so its cold first answer is the fixed cost of a cold start (Serve, the
tokenizer, one request).
The first load of each model (cold process, first imports) is a warm-up and not counted.

Each unload comes `--settle` seconds after the model's last load, as when a model serves a while: the spare worker
that deploy left behind (rayrunner.runtime.warm_workers) has imported the model stack by then; `--settle 0` measures
back-to-back reloads, which start in a spare that has not imported yet.

Run:  .venv/bin/python bench/bench_lifecycle.py [--cycles 3] [--isq Q8_0] [--floor] [--threads 2] [--settle 10]
It starts its own local Ray cluster (Serve and dashboard on free ports in 30000-32000) and shuts it down at the end.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import torch
from bench_cluster import start_cluster
from cpu_kind import cpu_line
from ray import serve
from transformers import AutoModelForCausalLM

from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.models.spec import model_app_name
from rayrunner.router.app import build_router_app

BASE_ID = "smollm2"


def isq_available(isq: str) -> str | None:
    """None when `quantize_model(model, isq, "cpu")` works on a tiny module, else why it does not."""
    try:
        from rayrunner.quantization import parse_isq, quantize_model

        parse_isq(isq)
        probe = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
        quantize_model(probe, isq, "cpu")
    except (ImportError, NotImplementedError, AttributeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def tiny_model(folder: str) -> str:
    """The tests' tiny random-weight Llama, saved to `folder`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for `tests`
    from tests.tiny_models import build_tiny_llama

    return build_tiny_llama(folder)


def bare_load(path: str, isq: str | None, mapped: bool = True) -> tuple[float, float]:
    """Seconds to load the folder in this process (memory-mapped, or read when not `mapped`), and to quantize it
    (0 without ISQ)."""
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, disable_mmap=not mapped).eval()
    loaded = time.perf_counter()
    if isq is not None:
        from rayrunner.quantization import quantize_model

        quantize_model(model, isq, "cpu")
    done = time.perf_counter()
    del model
    gc.collect()
    return loaded - start, done - loaded


class Admin:
    def __init__(self, http: httpx.Client, settle_s: float) -> None:
        self.http = http
        self.settle_s = settle_s  # a loaded model serves a while before it is unloaded (see --settle)

    def post(self, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        start = time.perf_counter()
        response = self.http.post(path, json=body)
        elapsed = time.perf_counter() - start
        if response.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {response.status_code} {response.text[:300]}")
        return elapsed, response.json()

    def status(self, model_id: str) -> str:
        return str(self.post("/v1/models/status", {"model_id": model_id})[1]["status"])

    def wait(self, model_id: str, wanted: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.status(model_id) != wanted:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{model_id} never became {wanted}")
            time.sleep(0.3)

    def cycle(self, model_id: str) -> dict[str, float]:
        time.sleep(self.settle_s)
        unload_s, result = self.post("/v1/models/unload", {"model_id": model_id})
        assert result["status"] == "unloaded", result
        began = time.time()
        reload_s, result = self.post("/v1/models/reload", {"model_id": model_id})
        ended = time.time()
        assert result["status"] == "loaded", result
        info = replica_info(model_id)  # started_at: the replica's wall clock when its engine was built
        first_s, answer = self.post("/v1/chat/completions", {
            "model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert answer["usage"]["completion_tokens"] == 1, answer
        load_s = float(info["load_time_s"])
        return {"unload": unload_s, "reload": reload_s, "pre_load": info["started_at"] - load_s - began,
                "replica_load": load_s, "post_load": ended - info["started_at"], "first": first_s}


    def first_answer_after(self, model_id: str, mode: str) -> float:
        """Unload by `mode` (`stop` or `sleep`), then time a one-token chat: the auto-reload or wake included."""
        time.sleep(self.settle_s)
        self.post("/v1/models/unload", {"model_id": model_id, "mode": mode})
        first_s, answer = self.post("/v1/chat/completions", {
            "model": model_id, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
        assert answer["usage"]["completion_tokens"] == 1, answer
        return first_s


def replica_info(model_id: str) -> dict[str, Any]:
    handle = serve.get_deployment_handle("ModelServer", app_name=model_app_name(model_id))
    return dict(handle.info.remote().result())


def measure(admin: Admin, model_id: str, isq: str | None, path: str, cycles: int) -> dict[str, float]:
    if admin.status(model_id) != "loaded":  # the first (cold) load of this model: a warm-up
        admin.post("/v1/models/reload", {"model_id": model_id})
    bare_load(path, isq)  # warm-up of the in-process side
    rows: list[dict[str, float]] = []
    for i in range(cycles):
        row = admin.cycle(model_id)
        row["bare_load"], row["bare_quant"] = bare_load(path, isq)
        row["bare"] = row["bare_load"] + row["bare_quant"]
        row["bare_read"] = sum(bare_load(path, isq, mapped=False))
        row["stop_first"] = admin.first_answer_after(model_id, "stop")
        row["sleep_first"] = admin.first_answer_after(model_id, "sleep")
        rows.append(row)
        print(f"  {model_id} cycle {i + 1}: " + ", ".join(f"{k} {v:.2f}s" for k, v in row.items()), flush=True)
    result = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    result["ratio"] = statistics.median(r["reload"] / r["bare"] for r in rows)
    result["sleep_ratio"] = statistics.median(r["sleep_first"] / r["stop_first"] for r in rows)
    result["cold_ratio"] = statistics.median(r["stop_first"] / r["bare"] for r in rows)
    result["cold_read_ratio"] = statistics.median(r["stop_first"] / r["bare_read"] for r in rows)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=3, help="unload/reload cycles per model (median reported)")
    parser.add_argument("--isq", default=None, help="also measure a model with this in_situ_quant, e.g. Q8_0")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="seconds a loaded model serves before each unload (the spare worker a deploy leaves "
                             "behind imports the model stack in ~4 s; 0 measures back-to-back reloads)")
    parser.add_argument("--floor", action="store_true",
                        help="also measure a tiny random-weight model: the fixed cost of a cold start")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (replica + driver)")
    parser.add_argument("--http-port", type=int, default=0, help="Serve HTTP port (default: free, 30000-32000)")
    parser.add_argument("--dashboard-port", type=int, default=0, help="dashboard port (default: free)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = {"torch_threads": args.threads, "num_cpus": 0.5}
    smollm2 = resolve(SMOLLM2).path
    scratch = tempfile.TemporaryDirectory(prefix="rayrunner-bench-")  # the registry's state, the tiny model
    models: list[tuple[str, str | None, str]] = [(BASE_ID, None, smollm2)]  # id, ISQ, folder
    if args.isq:
        why = isq_available(args.isq)
        if why is None:
            models.append((f"{BASE_ID}-{args.isq.lower()}", args.isq, smollm2))
        else:
            print(f"SKIPPING --isq {args.isq}: rayrunner.quantization is not usable yet ({why})")
    if args.floor:
        models.append(("tiny-random", None, tiny_model(str(Path(scratch.name) / "tiny-random"))))
    entries = [{"spec": {"model_id": mid, "which": {"type": "plain", "model_id": folder}, "in_situ_quant": isq,
                         "engine": engine}, "load": mid == BASE_ID} for mid, isq, folder in models]

    print(f"load average at start: {os.getloadavg()[0]:.2f} (machine has {os.cpu_count()} CPUs)")
    base = start_cluster(args.dashboard_port, args.http_port)
    results: dict[str, dict[str, float]] = {}
    try:
        with scratch as state_dir, httpx.Client(base_url=base, timeout=900) as http:
            config = {"models": entries, "default_model": BASE_ID,
                      "state_path": str(Path(state_dir) / "registry.json")}
            serve.run(build_router_app(config), name="rayrunner", route_prefix="/",
                      logging_config={"enable_access_log": False})
            admin = Admin(http, args.settle)
            assert http.get("/health").json() == {"status": "ok"}
            admin.wait(BASE_ID, "loaded")
            for model_id, isq, folder in models:
                results[model_id] = measure(admin, model_id, isq, folder, args.cycles)
                admin.post("/v1/models/unload", {"model_id": model_id})  # one replica at a time
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")

    print(f"\n{cpu_line()}\nUnload / reload via the router's admin HTTP API vs bare in-process load, {SMOLLM2}, bf16, "
          f"{args.threads} torch threads, median of {args.cycles} cycles (seconds)")
    header = ("model", "ISQ", "unload", "reload", "pre-load", "load", "post-load", "1st req", "bare load",
              "bare quant", "reload/bare")
    print(f"{header[0]:<14}{header[1]:<6}" + "".join(f"{h:>11}" for h in header[2:-1]) + f"{header[-1]:>13}")
    for (model_id, isq, _), r in zip(models, results.values(), strict=True):
        keys = ("unload", "reload", "pre_load", "replica_load", "post_load", "first", "bare_load", "bare_quant")
        print(f"{model_id:<14}{isq or '-':<6}" + "".join(f"{r[k]:>11.2f}" for k in keys) + f"{r['ratio']:>12.1f}x")
    print("reload = pre-load (Serve deploy, worker start, imports) + load (replica's load_time_s: weights, tokenizer,"
          " ISQ) + post-load (Serve readiness, registry polling, info call)")
    print("\nFirst answer (1 token) after an unload, the reload it triggers included (seconds, median)")
    for model_id, r in results.items():
        print(f"{model_id:<14} after stop {r['stop_first']:.2f}  after sleep {r['sleep_first']:.2f}  "
              f"sleep/stop {r['sleep_ratio']:.2f}x")
    print("\nCold reload to first answer (after stop) / bare in-process load (+ quantize), median of cycles' ratios")
    for model_id, r in results.items():
        print(f"{model_id:<14} / bare mapped ({r['bare']:.2f} s) {r['cold_ratio']:.1f}x   "
              f"/ bare read ({r['bare_read']:.2f} s) {r['cold_read_ratio']:.1f}x")
    summary = "; ".join(f"{mid}: unload {r['unload']:.2f} s, reload {r['reload']:.2f} s = {r['ratio']:.1f}x bare "
                        f"load{'+quantize' if isq else ''} ({r['bare']:.2f} s)"
                        for (mid, isq, _), r in zip(models, results.values(), strict=True))
    print(f"\nSUMMARY: {summary}")


if __name__ == "__main__":
    main()
