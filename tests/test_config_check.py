"""The serve config check, no cluster: the shipped configs pass, a bad field is one line that names it (with a hint
for a misspelling), the router's builder fails with that line in a way Serve does not retry, and scripts/serve.sh
checks before it runs `serve run`."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from rayrunner.cli.config_check import APP_ARGS, ConfigError, check_serve_config

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "serve_config.yaml"


def shipped() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(SHIPPED.read_text())
    return config


def problem(config: dict[str, Any], tmp_path: Path) -> str:
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError) as raised:
        check_serve_config(path)
    message = str(raised.value)
    assert "\n" not in message
    return message.removeprefix(f"{path}: ")


@pytest.mark.parametrize("path", [SHIPPED, ROOT / "cluster" / "serve_config.gpu.yaml"], ids=lambda p: p.name)
def test_the_shipped_configs_pass(path: Path) -> None:
    assert check_serve_config(path) >= 1


def test_each_checked_builder_exists() -> None:
    for import_path in APP_ARGS:
        module, name = import_path.split(":")
        assert callable(getattr(importlib.import_module(module), name))


def test_a_misspelt_engine_setting_is_named_with_a_hint(tmp_path: Path) -> None:
    config = shipped()
    router = config["applications"][1]["args"]
    router["models"][1]["spec"]["engine"] = {"max_num_seq": 4}
    assert problem(config, tmp_path) == (
        "applications[1].args.models[1].spec.engine.max_num_seq: unknown field (did you mean max_num_seqs?)")


def test_model_app_args_and_union_members_are_checked_without_pydantics_tags(tmp_path: Path) -> None:
    config = shipped()
    model_app = config["applications"][0]["args"]
    model_app["which"] = {"type": "plain", "modle_id": "smollm2-135m-instruct"}
    assert problem(config, tmp_path) == "applications[0].args.which.modle_id: unknown field (did you mean model_id?)"


def test_values_and_checks_across_fields(tmp_path: Path) -> None:
    config = shipped()
    config["applications"][1]["args"]["models"][0]["keep_alive"] = "soon"
    assert problem(config, tmp_path).startswith("applications[1].args.models[0].keep_alive: keep_alive `soon` is not")
    config = shipped()
    config["applications"][1]["args"]["default_model"] = "smoll"
    assert problem(config, tmp_path) == "applications[1].args: model `smoll` was not found"


def test_a_file_that_is_not_yaml(tmp_path: Path) -> None:
    path = tmp_path / "serve_config.yaml"
    path.write_text("applications: [\n")
    with pytest.raises(ConfigError, match=r"serve_config.yaml: not valid YAML \(") as raised:
        check_serve_config(path)
    assert "\n" not in str(raised.value)


def test_the_router_builder_fails_once_with_the_line() -> None:
    """Serve's build task retries any exception but RayServeException (3 more builds, ~25 s here, then a
    traceback); a RayServeException fails the deploy at once with its message as the app's status message."""
    from ray.serve.exceptions import RayServeException

    from rayrunner.router.app import build_router_app

    args = shipped()["applications"][1]["args"]
    args["limits"] = {"max_token": 5}
    with pytest.raises(RayServeException) as raised:
        build_router_app(args)
    assert str(raised.value) == "invalid router config: args.limits.max_token: unknown field (did you mean max_tokens?)"


def test_the_model_builder_fails_once_with_the_line() -> None:
    from ray.serve.exceptions import RayServeException

    from rayrunner.replica.model_server import build_model_app

    spec = {"model_id": "m", "which": {"type": "plain", "model_id": "m"}, "engine": {"max_num_seq": 3}}
    with pytest.raises(RayServeException, match=r"^invalid model spec: args.engine.max_num_seq: unknown field"):
        build_model_app(spec)


def test_serve_sh_checks_the_config_before_serve_run(tmp_path: Path) -> None:
    """scripts/serve.sh as shipped, beside an install.sh that only puts a stand-in `serve` and the venv on PATH."""
    scripts, bin_dir = tmp_path / "scripts", tmp_path / "bin"
    scripts.mkdir()
    bin_dir.mkdir()
    shutil.copy(ROOT / "scripts" / "serve.sh", scripts / "serve.sh")
    (scripts / "install.sh").write_text(f'cd "$(dirname "${{BASH_SOURCE[0]}}")/.."\n'
                                        f'export PATH="{bin_dir}:{Path(sys.executable).parent}:$PATH"\n')
    (bin_dir / "serve").write_text('#!/bin/sh\necho "serve $*"\n')
    (bin_dir / "serve").chmod(0o755)
    config = shipped()
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    ran = subprocess.run(["bash", str(scripts / "serve.sh")], capture_output=True, text=True, timeout=60,
                         env={**os.environ})
    assert ran.returncode == 0 and ran.stdout.endswith("serve run serve_config.yaml\n"), ran.stderr
    config["applications"][1]["args"]["models"][0]["pined"] = True
    (tmp_path / "serve_config.yaml").write_text(yaml.safe_dump(config))
    refused = subprocess.run(["bash", str(scripts / "serve.sh")], capture_output=True, text=True, timeout=60,
                             env={**os.environ})
    assert (refused.returncode, refused.stdout) == (1, "")
    assert refused.stderr == ("error: serve_config.yaml: applications[1].args.models[0].pined: unknown field "
                              "(did you mean pinned?)\n")


OPEN_MESSAGE = "applications[1].args.auth.allow_open: HTTP host `{}` is reachable from other machines and no API keys"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-head.internal"])
def test_an_open_router_on_a_host_other_machines_reach_is_refused(host: str, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RAYRUNNER_API_KEYS", "RAYRUNNER_ADMIN_API_KEYS"):
        monkeypatch.delenv(name, raising=False)
    config = shipped()
    config["http_options"]["host"] = host
    message = problem(config, tmp_path)
    assert message.startswith(OPEN_MESSAGE.format(host)) and "auth.allow_open: true" in message


@pytest.mark.parametrize("auth", [{"allow_open": True}, {"admin_api_keys": ["a"]}, {"api_keys": ["i"]}])
def test_an_explicit_allow_open_or_any_key_lets_it_bind_everywhere(auth: dict[str, Any], tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAYRUNNER_ADMIN_API_KEYS", raising=False)
    monkeypatch.delenv("RAYRUNNER_API_KEYS", raising=False)
    config = shipped()
    config["http_options"]["host"] = "0.0.0.0"
    config["applications"][1]["args"]["auth"] = auth
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert check_serve_config(path) == 2


def test_keys_from_the_environment_count_and_loopback_needs_none(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAYRUNNER_API_KEYS", raising=False)
    monkeypatch.delenv("RAY_SERVE_DEFAULT_HTTP_HOST", raising=False)
    config = shipped()
    path = tmp_path / "serve_config.yaml"
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"):
        config["http_options"]["host"] = host
        path.write_text(yaml.safe_dump(config))
        assert check_serve_config(path) == 2
    del config["http_options"]  # Serve's default: loopback
    path.write_text(yaml.safe_dump(config))
    assert check_serve_config(path) == 2
    monkeypatch.setenv("RAY_SERVE_DEFAULT_HTTP_HOST", "0.0.0.0")  # Serve's default moved off loopback
    assert problem(config, tmp_path).startswith(OPEN_MESSAGE.format("0.0.0.0"))
    monkeypatch.setenv("RAYRUNNER_ADMIN_API_KEYS", "from-env")
    assert check_serve_config(path) == 2


def test_the_router_refuses_the_same_at_start() -> None:
    """What `Router.__init__` runs on the host Serve's controller reports: the deploy fails naming the field."""
    from rayrunner.errors import InvalidRequestError
    from rayrunner.registry.config import ApiKeys

    with pytest.raises(InvalidRequestError, match="set auth.allow_open: true") as raised:
        ApiKeys().check_http_host("0.0.0.0")
    assert raised.value.param == "auth.allow_open"
    ApiKeys().check_http_host(None)  # Serve runs no HTTP proxy
    ApiKeys(allow_open=True).check_http_host("0.0.0.0")
