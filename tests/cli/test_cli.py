"""The `rayrunner` command against a real service over real HTTP: ps, lifecycle and admin commands, run, chat,
errors, API keys, and the installed console script (one module-scoped service of tiny random Llamas that asks
for keys)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from rayrunner.cli import app
from rayrunner.cli.tables import COLUMNS, human_bytes
from tests.conftest import Service, free_port, model_entry

CONFIG = Path(__file__).parents[2] / "serve_config.yaml"
ADMIN_KEY, USER_KEY = "sk-admin-cli", "sk-user-cli"  # the service asks for keys: the CLI must send them
SCRIPT = Path(sys.executable).parent / "rayrunner"


@pytest.fixture(scope="module")
def service(cluster: dict[str, Any], tiny_llama_dir: str) -> Iterator[Service]:
    config = {
        "models": [
            model_entry("alpha", tiny_llama_dir, aliases=["a"]),
            model_entry("org/beta", tiny_llama_dir, load=False, aliases=["b"]),
        ],
        "default_model": "alpha",
        "state_path": str(cluster["state_dir"] / "cli.json"),
        "auth": {"api_keys": [USER_KEY], "admin_api_keys": [ADMIN_KEY]},
    }
    svc = Service(cluster, config)
    svc.http.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
    svc.wait_loaded("alpha")
    yield svc
    svc.close()


def cli(service: Service, *args: str, stdin: str | None = None, key: str | None = ADMIN_KEY) -> Result:
    keyed = ["--api-key", key] if key else []
    return CliRunner().invoke(app, ["--url", service.url, *keyed, *args], input=stdin,
                              env={"RAYRUNNER_API_KEY": None, "RAYRUNNER_URL": None})


def ok(service: Service, *args: str, stdin: str | None = None) -> str:
    result = cli(service, *args, stdin=stdin)
    assert result.exit_code == 0, (result.stdout, result.stderr)
    return result.stdout


def failed(result: Result) -> str:
    """The one error line of a failed command."""
    assert result.exit_code == 1, result.stdout
    assert "Traceback" not in result.output
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    return result.stderr.removeprefix("error: ").rstrip("\n")


def table(text: str) -> dict[str, dict[str, str]]:
    """`ps` rows by model id, cut at the header's column starts."""
    header, *lines = text.splitlines()
    starts = [header.index(name) for name in COLUMNS]
    rows = {}
    for line in lines:
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
        rows[cells[0]] = dict(zip(COLUMNS, cells, strict=True))
    return rows


def chat_http(service: Service, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    body = {"model": "alpha", "messages": messages, "max_tokens": max_tokens}
    response = service.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_ps_lists_every_model_with_its_status(service: Service) -> None:
    rows = table(ok(service, "ps"))
    assert set(rows) == {"alpha", "org/beta"}
    alpha, beta = rows["alpha"], rows["org/beta"]
    weights = service.card("alpha")["weight_bytes"]
    assert (alpha["STATUS"], alpha["DEFAULT"], alpha["ALIASES"], alpha["MEMORY"]) == (
        "loaded", "*", "a", human_bytes(weights))
    assert (beta["STATUS"], beta["DEFAULT"], beta["ALIASES"], beta["MEMORY"]) == ("unloaded", "", "b", "-")
    listed = json.loads(ok(service, "ps", "--json"))
    assert [(m["id"], m["status"]) for m in listed] == [("alpha", "loaded"), ("org/beta", "unloaded")]


def test_unload_then_ps_shows_it_unloaded_in_either_mode(service: Service) -> None:
    assert ok(service, "reload", "b") == "org/beta: loaded\n"
    assert table(ok(service, "ps"))["org/beta"]["STATUS"] == "loaded"
    assert ok(service, "unload", "org/beta", "--mode", "sleep") == "org/beta: unloaded (sleeping)\n"
    sleeping = table(ok(service, "ps"))["org/beta"]
    held = service.card("org/beta")["held_bytes"]
    assert (sleeping["STATUS"], sleeping["MEMORY"], sleeping["UNLOADED"]) == (
        "unloaded (sleeping)", human_bytes(held), "user")
    assert ok(service, "unload", "b") == "org/beta: unloaded\n"
    stopped = table(ok(service, "ps"))["org/beta"]
    assert (stopped["STATUS"], stopped["MEMORY"], stopped["UNLOADED"]) == ("unloaded", "-", "user")


def test_errors_are_one_line_from_the_server(service: Service) -> None:
    assert failed(cli(service, "unload", "alhpa")) == "model `alhpa` was not found"
    assert failed(cli(service, "run", "alhpa", "hi")) == "model `alhpa` was not found"
    assert failed(cli(service, "chat", "alhpa", stdin="hi\n")) == "model `alhpa` was not found"
    conflict = service.http.post("/v1/models/reload", json={"model_id": "alpha"}).json()["error"]["message"]
    assert failed(cli(service, "reload", "alpha")) == conflict
    url = f"http://127.0.0.1:{free_port()}"
    refused = CliRunner().invoke(app, ["--url", url, "ps"])
    assert failed(refused).startswith(f"cannot reach rayrunner at {url}: ")


def test_the_api_key_is_sent_as_a_bearer_token(service: Service) -> None:
    assert failed(cli(service, "ps", key=None)) == "a valid API key is required (Authorization: Bearer <key>)"
    assert json.loads(ok(service, "ps", "--json"))  # an admin key reads, as does an inference key:
    assert cli(service, "ps", key=USER_KEY).exit_code == 0
    assert failed(cli(service, "unload", "b", key=USER_KEY)) == (
        "this key may not use the admin API (it needs an admin key)")


def test_run_prints_the_streamed_answer(service: Service) -> None:
    prompt = "What is the capital of France?"
    expected = chat_http(service, [{"role": "user", "content": prompt}], 8)["choices"][0]["message"]["content"]
    assert expected
    assert ok(service, "run", "a", prompt, "--max-tokens", "8") == expected + "\n"


def test_chat_sends_the_whole_history_each_turn(service: Service) -> None:
    system, first, second = "Be brief.", "Hello there", "What did I just say?"
    result = cli(service, "chat", "alpha", "--system", system, "--max-tokens", "6", "--verbose",
                 stdin=f"{first}\n\n{second}\n/exit\nnever sent\n")
    assert result.exit_code == 0, result.stderr
    history = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    answer1 = chat_http(service, history, 6)
    history += [{"role": "assistant", "content": answer1["choices"][0]["message"]["content"]},
                {"role": "user", "content": second}]
    answer2 = chat_http(service, history, 6)
    texts = [answer["choices"][0]["message"]["content"] for answer in (answer1, answer2)]
    assert result.stdout == f"{texts[0]}\n{texts[1]}\n"
    prompt_tokens = [int(n) for n in re.findall(r"prompt tokens: (\d+)", result.stderr)]
    assert prompt_tokens == [answer1["usage"]["prompt_tokens"], answer2["usage"]["prompt_tokens"]]
    assert prompt_tokens[1] > prompt_tokens[0] + answer1["usage"]["completion_tokens"]


def test_add_alias_default_remove_round_trip(service: Service, tiny_llama_dir: str) -> None:
    added = ok(service, "add", "gamma", "--source", tiny_llama_dir, "--isq", "Q8_0", "--alias", "g1", "--alias",
               "g2", "--no-load", "--pinned", "--keep-alive", "5m", "--replicas", "2")
    assert added == "gamma: unloaded\n"
    card = service.card("gamma")
    assert card["spec"]["engine"]["num_replicas"] == 2
    assert (card["spec"]["which"], card["spec"]["in_situ_quant"], card["aliases"], card["pinned"],
            card["keep_alive"]) == ({**card["spec"]["which"], "type": "plain", "model_id": tiny_llama_dir}, "Q8_0",
                                    ["g1", "g2"], True, "5m")
    assert table(ok(service, "ps"))["gamma"]["QUANT"] == "Q8_0"
    assert ok(service, "alias", "g1", "g3") == "gamma: aliases g1, g2, g3\n"
    assert ok(service, "default") == "alpha\n"
    assert ok(service, "default", "g3") == "default model: gamma\n"
    assert ok(service, "default") == "gamma\n"
    assert ok(service, "default", "a") == "default model: alpha\n"
    assert ok(service, "remove", "g2") == "gamma: removed\n"
    assert "gamma" not in table(ok(service, "ps"))
    assert failed(cli(service, "remove", "gamma")) == "model `gamma` was not found"


def test_pin_and_unpin_are_saved(service: Service) -> None:
    def saved() -> bool:
        return bool(json.loads(Path(service.config["state_path"]).read_text())["models"]["org/beta"]["pinned"])

    assert ok(service, "pin", "b") == "org/beta: pinned\n"
    assert service.card("org/beta")["pinned"] is True and saved()
    assert ok(service, "pin", "org/beta") == "org/beta: pinned\n"  # already pinned: no change, no error
    assert ok(service, "unpin", "b") == "org/beta: unpinned\n"
    assert service.card("org/beta")["pinned"] is False and not saved()
    assert failed(cli(service, "pin", "nope")) == "model `nope` was not found"
    assert failed(cli(service, "unpin", "b", key=USER_KEY)) == (
        "this key may not use the admin API (it needs an admin key)")


def test_scale_saves_replica_settings(service: Service) -> None:
    assert ok(service, "scale", "b", "--routing", "prefix") == "org/beta: 1 replicas, routing prefix\n"
    assert service.card("org/beta")["spec"]["engine"]["routing"] == "prefix"
    assert "num_replicas" in failed(cli(service, "scale", "b", "--replicas", "0"))
    assert ok(service, "scale", "b", "--routing", "least_loaded") == "org/beta: 1 replicas, routing least_loaded\n"


def test_the_installed_console_script(service: Service) -> None:
    env = {**os.environ, "RAYRUNNER_URL": service.url, "RAYRUNNER_API_KEY": ADMIN_KEY}

    def script(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)

    helped = script("--help")
    assert helped.returncode == 0 and all(name in helped.stdout for name in ("serve", "ps", "chat", "run"))
    listed = script("ps", "--json")
    assert listed.returncode == 0, listed.stderr
    assert {m["id"] for m in json.loads(listed.stdout)} >= {"alpha", "org/beta"}
    missing = script("unload", "alhpa")
    assert (missing.returncode, missing.stdout, missing.stderr) == (1, "", "error: model `alhpa` was not found\n")


@pytest.mark.slow  # starts `serve run`
def test_serve_runs_ray_serves_own_serve_run() -> None:
    absent = subprocess.run([str(SCRIPT), "serve", "no-such-config.yaml"], capture_output=True, text=True,
                            timeout=120)
    assert (absent.returncode, absent.stderr) == (1, "error: config file `no-such-config.yaml` not found\n")
    # `serve run` itself refuses the unknown option before it starts anything: proof that it received the call
    passed = subprocess.run([str(SCRIPT), "serve", str(CONFIG), "--no-such-option"], capture_output=True,
                            text=True, timeout=120)
    assert passed.returncode == 2 and "serve run" in passed.stderr and "--no-such-option" in passed.stderr


def test_check_config_and_serve_refuse_an_invalid_config_in_one_line(tmp_path: Path) -> None:
    assert CliRunner().invoke(app, ["check-config", str(CONFIG)]).stdout == f"{CONFIG}: ok (2 rayrunner apps)\n"
    bad = tmp_path / "serve_config.yaml"
    minilm = "            which: {type: embedding, model_id: all-minilm-l6-v2}\n"
    bad.write_text(CONFIG.read_text().replace(minilm, minilm + "            engine: {max_num_seq: 4}\n"))
    expected = (f"{bad}: applications[1].args.models[1].spec.engine.max_num_seq: unknown field "
                "(did you mean max_num_seqs?)")
    assert failed(CliRunner().invoke(app, ["check-config", str(bad)])) == expected
    # `serve` checks before `serve run` starts anything (which, with this config, would never serve)
    refused = subprocess.run([str(SCRIPT), "serve", str(bad)], capture_output=True, text=True, timeout=120)
    assert (refused.returncode, refused.stdout, refused.stderr) == (1, "", f"error: {expected}\n")
