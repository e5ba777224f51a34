"""Many models on memory for a few, over HTTP: `--models` copies of the builtin SmolLM2 (bf16, Q8_0 and Q4K under
their own ids) with room for `--room` of them, requests drawn by Zipf popularity (`--zipf`, 0: uniform) arriving
by `--arrivals` (Poisson, Gamma with CV 2 or 4, or the Azure LLM trace 2023's arrivals, `bench/traces/`) at each
rate of `--rates`. Each policy runs in its own fresh cluster, side by side in one run:

- `tiered`: rayrunner's default: a model evicted to make room sleeps (`evict_mode: sleep`) and wakes;
- `lru-stop`: what llama-swap and Ollama do: the least recently used model is stopped, and cold-starts next time;
- `static`: the `--room` most popular models pinned, never swapped; requests for the others are refused (failed);
- `resident`: no cap, every model loaded (the upper bound, holding all the weights).

Before a policy's runs every model is touched once (as a user's first requests would), so quantized weights come
from the cache and the evicted ones sit in the tier the policy sends them to. Each request is a streamed chat of
`--max-tokens` tokens; its TTFT is split by the tier its model was in when it arrived (resident, asleep, stopped,
loading), polled from `/v1/models`. Figures per run: requests, failed, TTFT p50/p99, p99 per tier, SLO attainment
(TTFT <= `--slo`), goodput (requests within the SLO per second), loads (wakes and cold loads, from the cards'
`load_count`) per 1,000 requests beside what Belady's offline optimum and plain LRU would make on the same
sequence, the most models seen loaded at once, and the models still loading once every request has its answer
(none, or a load is stuck). `--json` saves every request.

Run:  .venv/bin/python bench/bench_many_models.py [--policies tiered,lru-stop] [--rates 0.5,1] [--duration 120]
It starts its own local Ray cluster per policy (ports in 30000-32000) and shuts it down at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from many_models_workload import ARRIVALS, Request, belady_loads, lru_loads, workload
from rayrunner_service import smollm2_spec, wait_loaded

LEVELS = [None, "Q8_0", "Q4K"]
POLICIES = ("tiered", "lru-stop", "static", "resident")


def model_specs(count: int) -> list[dict[str, Any]]:
    """`count` ids over the builtin SmolLM2 at bf16, Q8_0 and Q4K in turn; the first is the most popular."""
    return [smollm2_spec(f"m{i}-{(LEVELS[i % 3] or 'bf16').lower()}", LEVELS[i % 3]) for i in range(count)]


def router_config(policy: str, specs: list[dict[str, Any]], room: int, state_dir: str) -> dict[str, Any]:
    models = [{"spec": spec, "load": False, "pinned": policy == "static" and i < room}
              for i, spec in enumerate(specs)]
    config: dict[str, Any] = {"models": models, "state_path": f"{state_dir}/registry.json"}
    if policy != "resident":
        config["max_loaded_models"] = room
    if policy == "lru-stop":
        config.update(evict_mode="stop", max_asleep_models=0)
    if policy == "tiered":
        config.update(evict_mode="sleep", max_asleep_models=len(specs) - room)
    return config


@dataclass
class Outcome:
    at: float
    model: str
    tier: str
    ttft: float | None
    error: str | None = None


class Tiers:
    """Each model's tier as `/v1/models` last showed it, polled every quarter second; the most loaded at once."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client, self.most_loaded = client, 0
        self.tiers: dict[str, str] = {}
        self.loads: dict[str, int] = {}

    async def poll(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(0.25)

    async def refresh(self) -> None:
        cards = (await self.client.get("/v1/models")).json()["data"]
        self.tiers = {card["id"]: _tier(card) for card in cards}
        self.loads = {card["id"]: card["load_count"] for card in cards}
        self.most_loaded = max(self.most_loaded, sum(t == "resident" for t in self.tiers.values()))


def _tier(card: dict[str, Any]) -> str:
    if card["status"] == "loaded":
        return "resident"
    if card["status"] == "reloading":
        return "loading"
    return "asleep" if card.get("unload_mode") == "sleep" else "stopped"


async def send(client: httpx.AsyncClient, request: Request, started: float, tiers: Tiers) -> Outcome:
    await asyncio.sleep(max(0.0, started + request.at - time.monotonic()))
    outcome = Outcome(request.at, request.model, tiers.tiers.get(request.model, "stopped"), None)
    sent = time.monotonic()
    body = {"model": request.model, "stream": True, "max_tokens": request.max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about the sea. " * max(1, request.prompt_tokens // 6)}]}
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return outcome
            async for line in response.aiter_lines():
                if line.startswith("data: {") and outcome.ttft is None and '"content"' in line:
                    outcome.ttft = time.monotonic() - sent
                if line.startswith("data: {") and '"error"' in line:
                    outcome.error = line[:200]
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def run_workload(base: str, requests: list[Request], refused: set[str]
                       ) -> tuple[list[Outcome], Tiers, dict[str, int]]:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        tiers = Tiers(client)
        await tiers.refresh()
        before = dict(tiers.loads)
        poller = asyncio.get_running_loop().create_task(tiers.poll())
        started = time.monotonic()
        outcomes = await asyncio.gather(*(send(client, r, started, tiers) for r in requests if r.model not in refused))
        outcomes += [Outcome(r.at, r.model, "refused", None, "not served by this policy")
                     for r in requests if r.model in refused]
        poller.cancel()
        await tiers.refresh()
        loads = {m: tiers.loads[m] - before.get(m, 0) for m in tiers.loads}
        return sorted(outcomes, key=lambda o: o.at), tiers, loads


def summary(outcomes: list[Outcome], loads: dict[str, int], room: int, slo: float, duration: float,
            most_loaded: int, left_loading: list[str]) -> dict[str, Any]:
    served = [o for o in outcomes if o.error is None and o.ttft is not None]
    ttfts = sorted(o.ttft for o in served if o.ttft is not None)
    sequence = [o.model for o in outcomes]
    by_tier = {tier: _p([o.ttft for o in served if o.tier == tier and o.ttft is not None], 0.99)
               for tier in ("resident", "asleep", "stopped", "loading")}
    within = sum(1 for t in ttfts if t <= slo)
    return {"requests": len(outcomes), "failed": len(outcomes) - len(served), "ttft_p50": _p(ttfts, 0.5),
            "ttft_p99": _p(ttfts, 0.99), "p99_by_tier": by_tier, "attainment": within / max(1, len(outcomes)),
            "goodput_rps": within / duration, "loads": sum(loads.values()),
            "loads_per_1000": 1000 * sum(loads.values()) / max(1, len(outcomes)),
            "belady_loads": belady_loads(sequence, room), "lru_loads": lru_loads(sequence, room),
            "most_loaded": most_loaded, "left_loading": left_loading}


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpu_kind() -> str:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    found = [flag for flag in ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f", "avx2") if flag in flags]
    return ", ".join(found) or "unknown"


def run_policy(policy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    import ray
    from bench_cluster import start_cluster
    from ray import serve

    from rayrunner.router.app import build_router_app

    specs = model_specs(args.models)
    ids = [spec["model_id"] for spec in specs]
    refused = set(ids[args.room:]) if policy == "static" else set()
    base = start_cluster()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="rayrunner-many-") as state_dir, \
                httpx.Client(base_url=base, timeout=900) as http:
            serve.run(build_router_app(router_config(policy, specs, args.room, state_dir)), name="rayrunner",
                      route_prefix="/", logging_config={"enable_access_log": False})
            for model_id in [m for m in ids if m not in refused]:  # each touched once, as first requests do
                reply = http.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 1, "messages": [
                    {"role": "user", "content": "Hi"}]})
                reply.raise_for_status()
            if policy in ("resident", "static"):
                for model_id in ids[: args.room] if policy == "static" else ids:
                    wait_loaded(http, model_id)
            time.sleep(args.settle)
            for rate in args.rates:
                for seed in range(args.seeds):
                    requests = workload(ids, args.zipf, args.arrivals, rate, args.duration, seed, args.max_tokens)
                    outcomes, tiers, loads = asyncio.run(run_workload(base, requests, refused))
                    row = {"policy": policy, "rate": rate, "seed": seed,
                           **summary(outcomes, loads, args.room, args.slo, args.duration, tiers.most_loaded,
                                     [m for m, tier in tiers.tiers.items() if tier == "loading"])}
                    print(_line(row), flush=True)
                    rows.append({**row, "outcomes": [asdict(o) for o in outcomes]})
            if args.json:  # the registry's log says when and why each model moved
                log = Path(state_dir) / "registry.log"
                if log.exists():
                    shutil.copy(log, args.json.with_name(f"{args.json.stem}-{policy}-registry.log"))
    finally:
        serve.shutdown()
        ray.shutdown()
    return rows


def _line(row: dict[str, Any]) -> str:
    def s(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    tiers = " ".join(f"{tier}={s(v)}" for tier, v in row["p99_by_tier"].items())
    return (f"{row['policy']:<9} rate {row['rate']:<4} seed {row['seed']}  n {row['requests']:<4} failed "
            f"{row['failed']:<3} TTFT p50 {s(row['ttft_p50'])} p99 {s(row['ttft_p99'])} s  p99 by tier [{tiers}]  "
            f"SLO {row['attainment']:.3f}  goodput {row['goodput_rps']:.2f}/s  loads {row['loads']} "
            f"({row['loads_per_1000']:.0f}/1000; Belady {row['belady_loads']}, LRU {row['lru_loads']})  "
            f"most loaded {row['most_loaded']}, left loading {row['left_loading'] or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=int, default=8)
    parser.add_argument("--room", type=int, default=3)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--arrivals", choices=ARRIVALS, default="poisson")
    parser.add_argument("--rates", type=lambda v: [float(x) for x in v.split(",")], default=[1.0])
    parser.add_argument("--duration", type=float, default=120.0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--slo", type=float, default=2.0)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the warm-up (spares import)")
    parser.add_argument("--policies", type=lambda v: v.split(","), default=list(POLICIES))
    parser.add_argument("--json", type=Path, help="save every run's requests here (and each policy's registry log "
                        "beside it)")
    args = parser.parse_args()
    print(f"CPU: {cpu_kind()}; {args.models} models, room for {args.room}, Zipf {args.zipf}, {args.arrivals} "
          f"arrivals, {args.duration:.0f} s per run, {args.max_tokens} tokens per request, SLO TTFT <= {args.slo} s")
    rows = [row for policy in args.policies for row in run_policy(policy, args)]
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    for rate in args.rates:
        found = {r["policy"]: r for r in rows if r["rate"] == rate and r["seed"] == 0}
        if "tiered" in found and "lru-stop" in found and found["lru-stop"]["ttft_p99"]:
            print(f"rate {rate}: tiered / lru-stop p99 TTFT "
                  f"{(found['tiered']['ttft_p99'] or 0) / found['lru-stop']['ttft_p99']:.2f}x")
        if "tiered" in found and "resident" in found and found["resident"]["goodput_rps"]:
            print(f"rate {rate}: tiered / resident goodput "
                  f"{found['tiered']['goodput_rps'] / found['resident']['goodput_rps']:.2f}x")
    print("attainment by rate:", {p: [round(r["attainment"], 3) for r in rows if r["policy"] == p and r["seed"] == 0]
                                  for p in args.policies})


if __name__ == "__main__":
    main()
