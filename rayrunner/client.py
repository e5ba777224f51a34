"""The Python API: `Runner` and `MultiModelBuilder`, mirroring mistral.rs's multi-model Runner.

A Runner is a client of the router deployment: every call goes through the router's `DeploymentHandle`, so Python,
handles and HTTP share one behaviour. Errors come back as rayrunner's `ValueError` subclasses. A Runner is safe to
use from many threads at once: concurrent requests reach the model deployment together and are batched there.
Runners in one process share one service, so a second `Runner(which=...)` for a model attaches to it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from rayrunner.errors import RayRunnerError, unwrap
from rayrunner.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
)
from rayrunner.source_policy import SourcePolicy
from rayrunner.spec import build_spec
from rayrunner.warm_workers import CLUSTER_ENV
from rayrunner.which import Which

APP_NAME = "rayrunner"


def _entry(model_id: str | None, which: Any, in_situ_quant: str | None, aliases: list[str], load: bool,
           engine: dict[str, Any] | None = None, pinned: bool = False,
           keep_alive: str | float | None = None) -> dict[str, Any]:
    parsed = Which.parse(which)
    spec = build_spec(model_id or parsed.source, parsed, in_situ_quant, engine)
    return {"spec": spec.model_dump(mode="json"), "aliases": aliases, "load": load, "pinned": pinned or None,
            "keep_alive": keep_alive}


class Runner:
    """Serve one or more models on a (local or attached) Ray cluster and talk to them from Python.

    `Runner(which=Which.Plain(model_id=...), in_situ_quant="Q4K")` connects to Ray (the cluster named by
    `address` or `RAY_ADDRESS`, or one started with `ray start`; else it starts its own), deploys the router if
    there is none, and registers and loads the model, or attaches to it if it is registered with the same spec.
    `Runner.connect()` attaches to a running rayrunner instead. `log_level` is the level of Ray's and Serve's
    console output when this Runner connects to Ray; replica logs reach the console only at `INFO` or below
    (they are always in Ray's log files).
    """

    def __init__(
        self,
        which: Any = None,
        in_situ_quant: str | None = None,
        model_id: str | None = None,
        *,
        engine: dict[str, Any] | None = None,
        address: str | None = None,
        http_port: int = 8000,
        state_path: str | None = None,
        app_name: str = APP_NAME,
        log_level: str | int = "WARNING",
        _models: list[dict[str, Any]] | None = None,
        _default: str | None = None,
    ) -> None:
        models = list(_models or [])
        if which is not None:
            models.insert(0, _entry(model_id, which, in_situ_quant, [], True, engine))
        self._owns_cluster = _start_ray(address, log_level)
        self.app_name = app_name
        self._handle = _ensure_router(app_name, http_port, state_path, self._owns_cluster)
        for entry in models:
            self._call("add_model_entry", entry)
        if _default is not None:
            self.set_default_model_id(_default)

    @classmethod
    def connect(cls, address: str | None = "auto", app_name: str = APP_NAME,
                log_level: str | int = "WARNING") -> Runner:
        """Attach to a running rayrunner router (e.g. one started by `serve run serve_config.yaml`)."""
        from ray import serve

        runner = cls.__new__(cls)
        runner._owns_cluster = _start_ray(address, log_level, attach_only=True)
        runner.app_name = app_name
        runner._handle = serve.get_app_handle(app_name)
        return runner

    # ------------------------------------------------------------ models

    def list_models(self) -> list[str]:
        """Ids of the loaded models."""
        return [m["model_id"] for m in self._cards() if m["status"] == "loaded"]

    def list_models_with_status(self) -> list[tuple[str, str]]:
        return [(m["model_id"], m["status"]) for m in self._cards()]

    def list_unloaded_models(self) -> list[str]:
        return [m["model_id"] for m in self._cards() if m["status"] == "unloaded"]

    def get_model_status(self, model_id: str) -> str:
        return str(self._call("get_model_status", model_id))

    def is_model_loaded(self, model_id: str) -> bool:
        return self.get_model_status(model_id) == "loaded"

    def get_default_model_id(self) -> str | None:
        result = self._call("get_default_model_id")
        return None if result is None else str(result)

    def set_default_model_id(self, model_id: str) -> None:
        self._call("set_default_model_id", model_id)

    def unload_model(self, model_id: str, mode: str = "stop") -> None:
        """`mode="stop"` frees everything (the replica exits); `"sleep"` keeps the replica process and frees the
        weights, so the next request or reload wakes it much faster. Either way the status is `unloaded`."""
        self._call("unload_model", model_id, mode)

    def reload_model(self, model_id: str) -> None:
        self._call("reload_model", model_id)

    def add_model(self, model_id: str, which: Any, in_situ_quant: str | None = None, aliases: tuple[str, ...] = (),
                  load: bool = True, engine: dict[str, Any] | None = None, *, pinned: bool = False,
                  keep_alive: str | float | None = None) -> None:
        """Register (and with `load`, load) a model. `pinned`: never evicted to make room; `keep_alive`: unload
        after this long idle ("5m", "30s", seconds, -1 forever)."""
        entry = _entry(model_id, which, in_situ_quant, list(aliases), load, engine, pinned, keep_alive)
        self._call("add_model_entry", entry)

    def add_alias(self, model_id: str, alias: str) -> None:
        self._call("add_alias", model_id, alias)

    def remove_model(self, model_id: str) -> None:
        self._call("remove_model", model_id)

    def model_card(self, model_id: str) -> dict[str, Any]:
        """Everything the registry knows about a model: spec, status, aliases, weight bytes, quantization, and
        for capacity `pinned`, `keep_alive`, `last_used_at`, `in_flight` and `unloaded_reason`."""
        result: dict[str, Any] = self._call("model_card", model_id)
        return result

    # ------------------------------------------------------------ requests

    def send_chat_completion_request(
        self, request: ChatCompletionRequest, model_id: str | None = None
    ) -> ChatCompletionResponse | Iterator[ChatCompletionChunk]:
        """A response, or with `request.stream=True` an iterator of chunks. `model_id` (None: the request's
        `model`, usually `default`) decides the route."""
        body = _body(request, model_id)
        if request.stream:
            return (ChatCompletionChunk.model_validate(c) for c in self._stream("chat_stream", body))
        return ChatCompletionResponse.model_validate(self._call("chat", body))

    def send_completion_request(
        self, request: CompletionRequest, model_id: str | None = None
    ) -> CompletionResponse | Iterator[CompletionResponse]:
        body = _body(request, model_id)
        if request.stream:
            return (CompletionResponse.model_validate(c) for c in self._stream("complete_stream", body))
        return CompletionResponse.model_validate(self._call("complete", body))

    def send_embedding_request(self, request: EmbeddingRequest, model_id: str | None = None) -> EmbeddingResponse:
        return EmbeddingResponse.model_validate(self._call("embed", _body(request, model_id)))

    def shutdown(self) -> None:
        """Stop Serve and Ray if this Runner started them; an attached Runner just lets go."""
        import ray
        from ray import serve

        if self._owns_cluster:
            serve.shutdown()
            ray.shutdown()

    # ------------------------------------------------------------ plumbing

    def _cards(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("list_models")
        return result

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._handle, method).remote(*args).result()
        except Exception as exc:
            raise _public_error(exc) from None

    def _stream(self, method: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        generator = getattr(self._handle.options(stream=True), method).remote(body)
        try:
            yield from generator
        except Exception as exc:
            raise _public_error(exc) from None
        finally:
            generator.cancel()


class MultiModelBuilder:
    """`MultiModelBuilder().add_model_with_alias("smol", Which.Plain(...)).with_default_model("smol").build()`."""

    def __init__(self) -> None:
        self._models: list[dict[str, Any]] = []
        self._default: str | None = None

    def add_model(self, which: Any, in_situ_quant: str | None = None, model_id: str | None = None,
                  load: bool = True, *, pinned: bool = False, keep_alive: str | float | None = None
                  ) -> MultiModelBuilder:
        self._models.append(_entry(model_id, which, in_situ_quant, [], load, None, pinned, keep_alive))
        return self

    def add_model_with_alias(self, alias: str, which: Any, in_situ_quant: str | None = None,
                             load: bool = True, *, pinned: bool = False, keep_alive: str | float | None = None
                             ) -> MultiModelBuilder:
        self._models.append(_entry(None, which, in_situ_quant, [alias], load, None, pinned, keep_alive))
        return self

    def with_default_model(self, model: str) -> MultiModelBuilder:
        self._default = model
        return self

    def build(self, **runner_options: Any) -> Runner:
        return Runner(_models=self._models, _default=self._default, **runner_options)


def _body(request: Any, model_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = request.model_dump()
    if model_id is not None:
        body["model"] = model_id
    return body


def _public_error(exc: BaseException) -> BaseException:
    found = unwrap(exc)
    return found if isinstance(found, RayRunnerError) else exc


def _start_ray(address: str | None, log_level: str | int, attach_only: bool = False) -> bool:
    """Connect to Ray; returns True when this call started a new local cluster (the Runner then owns it).

    Without an address it joins only a cluster named by `RAY_ADDRESS` or started with `ray start`, never some
    other process's private cluster that `address="auto"` would find."""
    import ray
    from ray._private.utils import read_ray_address

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    level = _level(log_level)
    # Serve configures its driver-side logger when imported: import it first, then set the level.
    import ray.serve  # noqa: F401

    logging.getLogger("ray.serve").setLevel(level)
    quiet: dict[str, Any] = {"logging_level": level, "log_to_driver": level <= logging.INFO}
    if attach_only:
        ray.init(address=address, **quiet)
        return False
    existing = address or os.environ.get("RAY_ADDRESS") or read_ray_address()
    if existing:
        ray.init(address=existing, **quiet)
        return False
    for name, value in CLUSTER_ENV.items():  # read by the raylet this starts: warm spare workers
        os.environ.setdefault(name, value)
    ray.init(address="local", include_dashboard=True, **quiet)
    return True


def _level(log_level: str | int) -> int:
    if isinstance(log_level, int):
        return log_level
    levels = logging.getLevelNamesMapping()
    if log_level.upper() not in levels:
        raise ValueError(f"log_level `{log_level}` is not one of {', '.join(levels)}")
    return levels[log_level.upper()]


def _ensure_router(app_name: str, http_port: int, state_path: str | None, fresh_cluster: bool) -> Any:
    """The router's handle, deploying the router first if the cluster has none."""
    from ray import serve

    from rayrunner.router.app import build_router_app

    if app_name in serve.status().applications:
        return serve.get_app_handle(app_name)
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    if state_path is None and fresh_cluster:
        # A Runner-owned cluster is ephemeral, like a mistral.rs Runner: start from an empty registry.
        state_path = os.path.join(tempfile.mkdtemp(prefix="rayrunner-"), "registry.json")
    # The Runner's own service trusts its own process: models may come from any local path or hub repository.
    config = {"state_path": state_path, "sources": SourcePolicy.allow_all().model_dump()}
    return serve.run(build_router_app(config), name=app_name, route_prefix="/")
