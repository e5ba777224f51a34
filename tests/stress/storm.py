"""The full-size request storm: 32 clients for 2 minutes by default (see `tests/stress/storm_core.py`).

Without `--url` it starts its own local Ray cluster with Serve (as the test fixtures do), builds a tiny random
Llama, deploys the storm's router (two tiny text models and `all-minilm-l6-v2`), storms it, checks the registry
against Serve, prints a summary table and tears everything down. With `--url` it storms a running service instead;
its config must hold the models named by `--text-model`, `--embedding-model` and `--transient-source`, and Serve is
checked only when `--ray-address` is given too. Exit status 1 when any problem was seen.

    python -m tests.stress.storm --clients 32 --duration 120
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests import conftest  # sets Ray's environment before Ray is imported
from tests.stress.storm_core import Models, Storm, settle, storm_config, summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (default 32)")
    parser.add_argument("--duration", type=float, default=120.0, help="storm seconds (default 120)")
    parser.add_argument("--op-interval", type=float, default=2.0, help="seconds between lifecycle operations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="storm this running service instead of starting one")
    parser.add_argument("--ray-address", help="with --url: the service's cluster, to check Serve's replica counts")
    parser.add_argument("--text-model", action="append", help="with --url: a text model id (repeatable)")
    parser.add_argument("--embedding-model", default="all-minilm-l6-v2", help="with --url: the embedding model")
    parser.add_argument("--transient-source", help="with --url: a local model folder the driver adds and removes")
    return parser.parse_args(argv)


def storm_and_report(url: str, models: Models, args: argparse.Namespace, check_serve: bool) -> int:
    import httpx

    storm = Storm(url, models, args.clients, args.duration, args.op_interval, args.seed)
    tally = storm.run()
    with httpx.Client(base_url=url, timeout=120) as http:
        tally.problems.extend(settle(http, check_serve))
    print(summary(tally, storm.elapsed_s))
    print(f"{'storm clients / planned seconds':<48}{args.clients:>4} / {args.duration:.0f}")
    return 1 if tally.problems else 0


def remote_models(args: argparse.Namespace) -> Models:
    if not args.text_model or not args.transient_source:
        sys.exit("--url needs --text-model (one or more) and --transient-source")
    return Models(text=tuple(args.text_model), text_names=(*args.text_model, "default"),
                  embedding=args.embedding_model, transient="storm-transient",
                  transient_which={"type": "plain", "model_id": args.transient_source})


def local_storm(args: argparse.Namespace) -> int:
    """Start a cluster like the test fixtures' (private ports, dashboard on), storm it, tear it down."""
    import ray
    from ray import serve

    from tests.tiny_models import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="rayrunner-storm-") as tmp:
        env = {k: os.environ[k] for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED", "HF_HUB_OFFLINE")}
        http_port = conftest.free_port()
        ray.init(address="local", num_cpus=4, include_dashboard=True, dashboard_port=conftest.free_port(),
                 runtime_env={"env_vars": env}, logging_level=logging.WARNING, log_to_driver=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                        logging_config={"enable_access_log": False})
            config, models = storm_config(build_tiny_llama(Path(tmp) / "tiny-llama"), f"{tmp}/storm.json")
            cluster: dict[str, Any] = {"http": f"http://127.0.0.1:{http_port}", "state_dir": Path(tmp)}
            service = conftest.Service(cluster, config)
            try:
                problems = settle(service.http, check_serve=True)
                if problems:
                    print("not ready:", problems)
                    return 1
                return storm_and_report(service.url, models, args, check_serve=True)
            finally:
                service.close()
        finally:
            serve.shutdown()
            ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.url:
        return local_storm(args)
    if args.ray_address:
        import ray

        ray.init(address=args.ray_address, logging_level=logging.WARNING, log_to_driver=False)
    return storm_and_report(args.url, remote_models(args), args, check_serve=bool(args.ray_address))


if __name__ == "__main__":
    sys.exit(main())
