"""A serve config checked before `serve run`: each rayrunner app's `args` against the pydantic model its builder
validates them with, reported as one line that names the field.

`serve run` submits a config and then only waits: an app whose builder raises is retried by Serve and ends
DEPLOY_FAILED, its reason in Ray's logs, while `serve run` keeps running and serves nothing. `rayrunner serve`,
`rayrunner check-config` and scripts/serve.sh run this check first, and the builders report a bad `args` with the
same line (`builder_args`). It also refuses a router with no API keys (in its args or this process's
environment) on an `http_options.host` other machines can reach, unless its `auth.allow_open` says so; the router
refuses the same at start, from the host Serve actually binds. No Ray here: the check runs in a plain process in
well under a second.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import ModelSpec
from rayrunner.registry.config import RegistryConfig
from rayrunner.runtime.app_args import args_problem

# Each rayrunner application builder and the model it validates its `args` with (tests check both resolve).
APP_ARGS: dict[str, type[BaseModel]] = {
    "rayrunner.router.app:build_router_app": RegistryConfig,
    "rayrunner.replica.model_server:build_model_app": ModelSpec,
    "rayrunner.deployments.model_server:build_model_app": ModelSpec,  # its path before the replica/ folder
}


class ConfigError(ValueError):
    """A config that cannot serve; the message is one line naming the file and the field."""


def check_serve_config(path: Path) -> int:
    """Raise ConfigError for the first problem in the serve config at `path`; return how many rayrunner apps
    were checked."""
    try:
        config = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    apps = config.get("applications") if isinstance(config, dict) else None
    if not isinstance(apps, list):
        raise ConfigError(f"{path}: applications: a list of Serve applications is required")
    checked = 0
    for index, app in enumerate(apps):
        model = APP_ARGS.get(app.get("import_path", "")) if isinstance(app, dict) else None
        if model is None:
            continue  # not rayrunner's: `serve run` checks it against Serve's own schema
        args = app.get("args") or {}
        problem = args_problem(model, args)
        if problem is None and model is RegistryConfig:
            problem = _open_bind_problem(RegistryConfig.model_validate(args), http_host(config))
        if problem is not None:
            raise ConfigError(f"{path}: applications[{index}].args{problem}")
        checked += 1
    return checked


def http_host(config: dict[str, Any]) -> str | None:
    """The host Serve's proxies will bind for this config: `http_options.host`, else Serve's default
    (`RAY_SERVE_DEFAULT_HTTP_HOST`, else loopback)."""
    options = config.get("http_options")
    if isinstance(options, dict) and "host" in options:
        host = options["host"]
        return None if host is None else str(host)
    return os.environ.get("RAY_SERVE_DEFAULT_HTTP_HOST") or "127.0.0.1"


def _open_bind_problem(router: RegistryConfig, host: str | None) -> str | None:
    try:
        router.auth.check_http_host(host)
    except InvalidRequestError as exc:
        return f".{exc.param}: {exc.message}"
    return None
