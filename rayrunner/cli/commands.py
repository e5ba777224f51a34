"""The `rayrunner` typer app: `serve`, `check-config`, `ps`, the admin commands, `chat` and `run`.

Every command but `serve` and `check-config` talks to a running service at `--url` (`RAYRUNNER_URL`) with `--api-key`
(`RAYRUNNER_API_KEY`); each prints a short line (or a table, or an answer) and exits 0, or prints one error line
on stderr and exits 1.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, ParamSpec

import typer
from rich.console import Console

from rayrunner.cli.api import DEFAULT_URL, Api, CliError
from rayrunner.cli.config_check import ConfigError, check_serve_config
from rayrunner.cli.conversation import Conversation, Sampling, chat_loop, run_once
from rayrunner.cli.tables import print_models
from rayrunner.runtime.warm_workers import CLUSTER_ENV

app = typer.Typer(
    name="rayrunner",
    help="Run rayrunner, and manage and talk to a running one (many LLMs behind one OpenAI-compatible endpoint).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
P = ParamSpec("P")

DEFAULT_CONFIG = Path("serve_config.yaml")
# As scripts/install.sh sets them: token auth off for the cluster and its drivers alike, no usage stats, warm
# spare workers (rayrunner.runtime.warm_workers).
SERVE_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **CLUSTER_ENV}
WIDE = 1000  # a table written to a pipe or file is not wrapped to 80 columns


class UnloadMode(str, Enum):
    stop = "stop"
    sleep = "sleep"


class ModelType(str, Enum):
    plain = "plain"
    gguf = "gguf"
    multimodal_plain = "multimodal_plain"
    embedding = "embedding"
    lora = "lora"


# The `which` field that holds --source, per model type (the others call it model_id).
SOURCE_FIELD = {ModelType.gguf: "quantized_model_id"}

ModelArg = Annotated[str, typer.Argument(metavar="MODEL", help="Model id or alias.", show_default=False)]
ConfigArg = Annotated[Path, typer.Argument(metavar="CONFIG", help="Serve config file (for `serve`, extra options "
                                           "go to `serve run`).")]
SystemOpt = Annotated[str | None, typer.Option("--system", "-s", help="System prompt.", show_default=False)]
MaxTokensOpt = Annotated[int | None, typer.Option("--max-tokens", min=1, help="Most tokens per answer.",
                                                  show_default=False)]
TemperatureOpt = Annotated[float | None, typer.Option("--temperature", min=0.0, max=2.0,
                                                      help="Sampling temperature (unset or 0: greedy).",
                                                      show_default=False)]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="Print token counts and speed on stderr.")]


@app.callback()
def connect(
    ctx: typer.Context,
    url: Annotated[str, typer.Option(envvar="RAYRUNNER_URL", metavar="URL", help="The service's base URL.")]
    = DEFAULT_URL,
    api_key: Annotated[str | None, typer.Option(envvar="RAYRUNNER_API_KEY", metavar="KEY", show_default=False,
                                                help="Sent as `Authorization: Bearer <key>`.")] = None,
) -> None:
    ctx.obj = {"url": url, "api_key": api_key}


def command(**settings: Any) -> Callable[[Callable[P, None]], Callable[P, None]]:
    """`app.command`, with a CliError printed as one line on stderr and exit status 1."""

    def register(func: Callable[P, None]) -> Callable[P, None]:
        @functools.wraps(func)
        def reported(*args: P.args, **kwargs: P.kwargs) -> None:
            try:
                func(*args, **kwargs)
            except CliError as exc:
                typer.echo(f"error: {exc.message}", err=True)
                raise typer.Exit(1) from None

        app.command(**settings)(reported)
        return reported

    return register


def _value(metavar: str, help_text: str, *names: str) -> Any:
    """An option that takes a value, shown as METAVAR, with no default printed."""
    return typer.Option(*names, metavar=metavar, help=help_text, show_default=False)


def _api(ctx: typer.Context) -> Api:
    api = Api(ctx.obj["url"], ctx.obj["api_key"])
    ctx.call_on_close(api.close)
    return api


@command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def serve(ctx: typer.Context, config: ConfigArg = DEFAULT_CONFIG) -> None:
    """Run the service in the foreground: Ray Serve's `serve run CONFIG`, with scripts/serve.sh's Ray settings
    (RAY_AUTH_MODE=disabled, RAY_USAGE_STATS_ENABLED=0, RAY_preload_python_modules) where the environment does
    not set them. The config is checked first (see `check-config`)."""
    _checked(config)
    here = Path(sys.executable).parent
    exe = shutil.which("serve", path=str(here)) or shutil.which("serve")
    if exe is None:
        raise CliError("Ray Serve's `serve` command was not found (pip install 'ray[serve]')")
    for name, value in SERVE_ENV.items():
        os.environ.setdefault(name, value)
    sys.stdout.flush()
    os.execv(exe, [exe, "run", str(config), *ctx.args])


@command(name="check-config")
def check_config(config: ConfigArg = DEFAULT_CONFIG) -> None:
    """Check a serve config's rayrunner apps (router and model args) as their builders will, without Ray: exit 1
    with one line naming the first invalid field."""
    checked = _checked(config)
    typer.echo(f"{config}: ok ({checked} rayrunner app{'s' if checked != 1 else ''})")


def _checked(config: Path) -> int:
    if not config.is_file():
        raise CliError(f"config file `{config}` not found")
    try:
        return check_serve_config(config)
    except ConfigError as exc:
        raise CliError(str(exc)) from None


@command()
def ps(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Every model object, as JSON.")] = False,
) -> None:
    """List every model: status, kind, aliases, default, memory, quantization, requests in flight, errors."""
    models = _api(ctx).get("/v1/models")["data"]
    if as_json:
        typer.echo(json.dumps(models, indent=2))
        return
    print_models(models, Console(highlight=False, width=None if sys.stdout.isatty() else WIDE))


@command()
def unload(
    ctx: typer.Context,
    model: ModelArg,
    mode: Annotated[UnloadMode, typer.Option(help="stop: no replica left; sleep: the replica stays, weights freed "
                                                  "(a faster wake).")] = UnloadMode.stop,
) -> None:
    """Unload a model (it reloads on its next request)."""
    answer = _api(ctx).post("/v1/models/unload", {"model_id": model, "mode": mode.value})
    typer.echo(f"{answer['model_id']}: unloaded" + (" (sleeping)" if mode is UnloadMode.sleep else ""))


@command()
def reload(ctx: typer.Context, model: ModelArg) -> None:
    """Load an unloaded model now."""
    answer = _api(ctx).post("/v1/models/reload", {"model_id": model})
    typer.echo(f"{answer['model_id']}: {answer['status']}")


@command()
def remove(ctx: typer.Context, model: ModelArg) -> None:
    """Unload a model and forget it."""
    answer = _api(ctx).post("/v1/models/remove", {"model_id": model})
    typer.echo(f"{answer['model_id']}: removed")


@command()
def default(
    ctx: typer.Context,
    model: Annotated[str | None, typer.Argument(metavar="MODEL", help="Make this model the default.",
                                                show_default=False)] = None,
) -> None:
    """Show the default model, or set it."""
    api = _api(ctx)
    if model is None:
        typer.echo(api.get("/v1/models/default")["id"])
        return
    card = api.post("/v1/models/default", {"model_id": model})
    typer.echo(f"default model: {card['id']}")


@command()
def alias(ctx: typer.Context, model: ModelArg,
          name: Annotated[str, typer.Argument(metavar="ALIAS", help="The new alias.", show_default=False)]) -> None:
    """Give a model another name."""
    card = _api(ctx).post("/v1/models/aliases", {"model_id": model, "alias": name})
    typer.echo(f"{card['id']}: aliases {', '.join(card['aliases'])}")


@command()
def pin(ctx: typer.Context, model: ModelArg) -> None:
    """Never evict a model to make room for another (its keep_alive still applies)."""
    card = _api(ctx).post("/v1/models/pin", {"model_id": model})
    typer.echo(f"{card['id']}: pinned")


@command()
def scale(ctx: typer.Context, model: ModelArg,
          replicas: Annotated[int | None, _value("N", "Replicas while loaded.")] = None,
          routing: Annotated[str | None, _value("POLICY", "least_loaded or prefix.")] = None) -> None:
    """New replica settings for a model; a loaded one rescales in place (no replica restarts)."""
    changes = {"num_replicas": replicas, "routing": routing}
    body = {"model_id": model, **{key: value for key, value in changes.items() if value is not None}}
    card = _api(ctx).post("/v1/models/scale", body)
    engine = card["spec"]["engine"]
    scaling = engine["autoscaling_config"]
    count = f"{scaling['min_replicas']}-{scaling['max_replicas']}" if scaling else str(engine["num_replicas"])
    typer.echo(f"{card['id']}: {count} replicas, routing {engine['routing']}")


@command()
def unpin(ctx: typer.Context, model: ModelArg) -> None:
    """Let a pinned model be evicted to make room again."""
    card = _api(ctx).post("/v1/models/unpin", {"model_id": model})
    typer.echo(f"{card['id']}: unpinned")


@command()
def add(
    ctx: typer.Context,
    model_id: Annotated[str, typer.Argument(metavar="MODEL_ID", help="The new model's id.", show_default=False)],
    source: Annotated[str, _value("PATH_OR_ID", "Local folder, hub id or builtin name (gguf: a folder, hub id "
                                  "or .gguf file; lora: the base model).")],
    model_type: Annotated[ModelType, typer.Option("--type", help="The model's kind.")] = ModelType.plain,
    adapter: Annotated[str | None, _value("PATH_OR_ID", "lora: the adapter's folder or hub id.")] = None,
    isq: Annotated[str | None, _value("LEVEL", "In-situ quantization, e.g. Q4K, Q8_0.")] = None,
    aliases: Annotated[list[str] | None, _value("ALIAS", "An alias (repeat for more).", "--alias")] = None,
    load: Annotated[bool, typer.Option(help="Load it now (else on its first request).")] = True,
    pinned: Annotated[bool, typer.Option("--pinned", help="Never evicted to make room for other models.")] = False,
    keep_alive: Annotated[str | None, _value("DURATION", 'Unload after this idle time ("5m", "30s", seconds, '
                                             "-1: never).")] = None,
    replicas: Annotated[int, _value("N", "Replicas while loaded.")] = 1,
) -> None:
    """Register a model (and load it, unless --no-load)."""
    body = {"model_id": model_id, "which": _which(model_type, source, adapter), "in_situ_quant": isq,
            "aliases": aliases or [], "load": load, "pinned": pinned, "keep_alive": keep_alive,
            "engine": {"num_replicas": replicas}}
    card = _api(ctx).post("/v1/models/add", body)
    typer.echo(f"{card['id']}: {card['status']}")


def _which(model_type: ModelType, source: str, adapter: str | None) -> dict[str, Any]:
    if (adapter is None) == (model_type is ModelType.lora):
        raise CliError("--adapter goes with --type lora (and --type lora needs it)")
    which = {"type": model_type.value, SOURCE_FIELD.get(model_type, "model_id"): source}
    return which if adapter is None else {**which, "adapter": adapter}


@command()
def chat(
    ctx: typer.Context,
    model: Annotated[str, typer.Argument(metavar="MODEL", help="Model id or alias.")] = "default",
    system: SystemOpt = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Chat with a model: each line of stdin is a turn (/exit or EOF ends); the whole history goes with each."""
    conversation = Conversation.start(_api(ctx), model, system, Sampling(max_tokens, temperature), verbose)
    chat_loop(conversation)


@command()
def run(
    ctx: typer.Context,
    model: ModelArg,
    prompt: Annotated[str, typer.Argument(metavar="PROMPT", help="The user message.", show_default=False)],
    system: SystemOpt = None,
    max_tokens: MaxTokensOpt = None,
    temperature: TemperatureOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Print one streamed answer to PROMPT."""
    run_once(_api(ctx), model, prompt, system, Sampling(max_tokens, temperature), verbose)
