"""The Python API: `Runner` and `MultiModelBuilder`, mirroring mistral.rs's multi-model Runner.

A Runner is a client of the router deployment: every call goes through the router's `DeploymentHandle`, so Python,
handles and HTTP share one behaviour. Errors come back as rayrunner's `ValueError` subclasses. A Runner is safe to
use from many threads at once: concurrent requests reach the model deployment together and are batched there.

Runners in one process share one service, but, as in mistral.rs, each `Runner(which=...)` holds the models it was
built with (and those added through it): its `list_models*` show those, its `default` is its first model, and a
request without `model_id` goes there. A second Runner for the same model with the same spec attaches to it; with
another spec (say another `in_situ_quant`) its model is registered beside the first under an id derived from the spec
(`<id>@Q4K`), which that Runner also answers to by the plain id. `Runner.connect()` sees the whole service.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

from rayrunner.errors import RayRunnerError, SpecMismatchError, unwrap
from rayrunner.models.source_policy import SourcePolicy
from rayrunner.models.spec import DEFAULT_MODEL, build_spec
from rayrunner.models.which import Which
from rayrunner.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
)
from rayrunner.runtime import ray_private
from rayrunner.runtime.core_share import node_cores
from rayrunner.runtime.warm_workers import CLUSTER_ENV

APP_NAME = "rayrunner"
CPU_SLOTS_PER_CORE = 4  # of a cluster a Runner starts (see `_start_ray`)


def _entry(model_id: str | None, which: Any, in_situ_quant: str | None, aliases: list[str], load: bool,
           engine: dict[str, Any] | None = None, pinned: bool = False,
           keep_alive: str | float | None = None) -> dict[str, Any]:
    parsed = Which.parse(which)
    spec = build_spec(model_id or parsed.source, parsed, in_situ_quant, engine)
    return {"spec": spec.model_dump(mode="json"), "aliases": aliases, "load": load, "pinned": pinned or None,
            "keep_alive": keep_alive}


def spec_variant_ids(spec: dict[str, Any]) -> list[str]:
    """Ids a spec may take when its plain id is registered with another spec: `<id>@<ISQ>` (or `@full` without
    one), then that plus a short hash of the whole spec, so one spec always lands on the same id."""
    base = f"{spec['model_id']}@{spec.get('in_situ_quant') or 'full'}"
    load_config = {key: value for key, value in spec.items() if key != "model_id"}
    digest = hashlib.sha1(json.dumps(load_config, sort_keys=True).encode()).hexdigest()[:6]
    return [base, f"{base}-{digest}"]


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
        _models: list[tuple[dict[str, Any], bool]] | None = None,
        _default: str | None = None,
    ) -> None:
        models = list(_models or [])
        if which is not None:
            models.insert(0, (_entry(model_id, which, in_situ_quant, [], True, engine), model_id is None))
        self._owns_cluster = _start_ray(address, log_level)
        self.app_name = app_name
        self._handle = _ensure_router(app_name, http_port, state_path, self._owns_cluster)
        self._scoped = bool(models)  # a Runner built without models sees the whole service, as `connect` does
        self._own: list[str] = []  # ids of the models this Runner holds, in the order it got them
        self._plain_ids: dict[str, str] = {}  # a plain id this Runner's model took a spec-derived id for -> that id
        self._default: str | None = None
        for entry, derivable in models:
            self._register(entry, derivable)
        if _default is not None:
            self.set_default_model_id(_default)

    @classmethod
    def connect(cls, address: str | None = "auto", app_name: str = APP_NAME,
                log_level: str | int = "WARNING") -> Runner:
        """Attach to a running rayrunner router (e.g. one started by `serve run serve_config.yaml`): this Runner
        sees and changes the whole service (every model, the service's default)."""
        from ray import serve

        runner = cls.__new__(cls)
        runner._owns_cluster = _start_ray(address, log_level, attach_only=True)
        runner.app_name = app_name
        runner._handle = serve.get_app_handle(app_name)
        runner._scoped, runner._own, runner._plain_ids, runner._default = False, [], {}, None
        return runner

    # ------------------------------------------------------------ models

    def list_models(self) -> list[str]:
        """Ids of the loaded models (of this Runner's, unless it was made by `connect`)."""
        return [m["model_id"] for m in self._cards() if m["status"] == "loaded"]

    def list_models_with_status(self) -> list[tuple[str, str]]:
        return [(m["model_id"], m["status"]) for m in self._cards()]

    def list_unloaded_models(self) -> list[str]:
        return [m["model_id"] for m in self._cards() if m["status"] == "unloaded"]

    def get_model_status(self, model_id: str) -> str:
        return str(self._call("get_model_status", self._name(model_id)))

    def is_model_loaded(self, model_id: str) -> bool:
        return self.get_model_status(model_id) == "loaded"

    def get_default_model_id(self) -> str | None:
        """This Runner's default: its first model unless set (the service's default for a connected Runner)."""
        if self._scoped and self._default is not None:
            return self._default
        result = self._call("get_default_model_id")
        return None if result is None else str(result)

    def set_default_model_id(self, model_id: str) -> None:
        """Route requests without a model here; also the service's default, which HTTP clients get."""
        card = self._call("set_default_model_id", self._name(model_id))
        self._default = str(card["model_id"])

    def unload_model(self, model_id: str, mode: str = "stop") -> None:
        """`mode="stop"` frees everything (the replica exits); `"sleep"` keeps the replica process and frees the
        weights, so the next request or reload wakes it much faster. Either way the status is `unloaded`."""
        self._call("unload_model", self._name(model_id), mode)

    def reload_model(self, model_id: str) -> None:
        self._call("reload_model", self._name(model_id))

    def add_model(self, model_id: str, which: Any, in_situ_quant: str | None = None, aliases: tuple[str, ...] = (),
                  load: bool = True, engine: dict[str, Any] | None = None, *, pinned: bool = False,
                  keep_alive: str | float | None = None) -> None:
        """Register (and with `load`, load) a model, which this Runner then holds. `pinned`: never evicted to make
        room; `keep_alive`: unload after this long idle ("5m", "30s", seconds, -1 forever)."""
        self._register(_entry(model_id, which, in_situ_quant, list(aliases), load, engine, pinned, keep_alive), False)

    def pin_model(self, model_id: str) -> None:
        """Never evict the model to make room for another (keep_alive still applies); saved in the registry."""
        self._call("pin_model", self._name(model_id))

    def unpin_model(self, model_id: str) -> None:
        self._call("unpin_model", self._name(model_id))

    def scale_model(self, model_id: str, num_replicas: int | None = None,
                    autoscaling_config: dict[str, Any] | None = None, routing: str | None = None) -> None:
        """New replica settings, saved; a loaded model rescales in place (no replica restarts, no request lost)."""
        changes = {"num_replicas": num_replicas, "autoscaling_config": autoscaling_config, "routing": routing}
        self._call("scale_model", self._name(model_id), {k: v for k, v in changes.items() if v is not None})

    def add_alias(self, model_id: str, alias: str) -> None:
        self._call("add_alias", self._name(model_id), alias)

    def remove_model(self, model_id: str) -> None:
        """Forget a model in the whole service (other Runners holding it lose it too)."""
        removed = str(self._call("remove_model", self._name(model_id))["model_id"])
        self._own = [own for own in self._own if own != removed]
        self._plain_ids = {plain: own for plain, own in self._plain_ids.items() if own != removed}
        if self._default == removed:
            self._default = self._own[0] if self._own else None

    def model_card(self, model_id: str) -> dict[str, Any]:
        """Everything the registry knows about a model: spec, status, aliases, weight bytes, quantization, and
        for capacity `pinned`, `keep_alive`, `last_used_at`, `in_flight` and `unloaded_reason`."""
        result: dict[str, Any] = self._call("model_card", self._name(model_id))
        return result

    # ------------------------------------------------------------ requests

    def send_chat_completion_request(
        self, request: ChatCompletionRequest, model_id: str | None = None
    ) -> ChatCompletionResponse | Iterator[ChatCompletionChunk]:
        """A response, or with `request.stream=True` an iterator of chunks. `model_id` (None: the request's
        `model`, usually `default`: this Runner's default model) decides the route."""
        body = self._body(request, model_id)
        if request.stream:
            return (ChatCompletionChunk.model_validate(c) for c in self._stream("chat_stream", body))
        return ChatCompletionResponse.model_validate(self._call("chat", body))

    def send_completion_request(
        self, request: CompletionRequest, model_id: str | None = None
    ) -> CompletionResponse | Iterator[CompletionResponse]:
        body = self._body(request, model_id)
        if request.stream:
            return (CompletionResponse.model_validate(c) for c in self._stream("complete_stream", body))
        return CompletionResponse.model_validate(self._call("complete", body))

    def send_embedding_request(self, request: EmbeddingRequest, model_id: str | None = None) -> EmbeddingResponse:
        return EmbeddingResponse.model_validate(self._call("embed", self._body(request, model_id)))

    def shutdown(self) -> None:
        """Stop Serve and Ray if this Runner started them; an attached Runner just lets go."""
        import ray
        from ray import serve

        if self._owns_cluster:
            serve.shutdown()
            ray.shutdown()

    # ------------------------------------------------------------ plumbing

    def _register(self, entry: dict[str, Any], derivable: bool) -> None:
        """Add (or attach to) the entry's model; a spec that clashes with a registered one of the same plain id
        takes a spec-derived id instead, unless the caller named the id."""
        plain = entry["spec"]["model_id"]
        model_id = self._add_first_free(entry, spec_variant_ids(entry["spec"]) if derivable else [])
        if model_id != plain:
            self._plain_ids[plain] = model_id
        if model_id not in self._own:
            self._own.append(model_id)
        self._default = self._default or model_id

    def _add_first_free(self, entry: dict[str, Any], fallback_ids: list[str]) -> str:
        """The id the entry's model got: its own, or the first fallback not registered with another spec."""
        try:
            return str(self._call("add_model_entry", entry)["model_id"])
        except SpecMismatchError:
            if not fallback_ids:
                raise
        renamed = {**entry, "spec": {**entry["spec"], "model_id": fallback_ids[0]}}
        return self._add_first_free(renamed, fallback_ids[1:])

    def _name(self, name: str) -> str:
        """What a name means to this Runner: `default` is its default model, a plain id its own variant."""
        if name == DEFAULT_MODEL and self._scoped and self._default is not None:
            return self._default
        return self._plain_ids.get(name, name)

    def _body(self, request: Any, model_id: str | None) -> dict[str, Any]:
        body: dict[str, Any] = request.model_dump()
        body["model"] = self._name(model_id if model_id is not None else body["model"])
        return body

    def _cards(self) -> list[dict[str, Any]]:
        cards: list[dict[str, Any]] = self._call("list_models")
        if not self._scoped:
            return cards
        by_id = {card["model_id"]: card for card in cards}
        return [by_id[model_id] for model_id in self._own if model_id in by_id]

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
        self._models: list[tuple[dict[str, Any], bool]] = []  # each with whether its id may be spec-derived
        self._default: str | None = None

    def add_model(self, which: Any, in_situ_quant: str | None = None, model_id: str | None = None,
                  load: bool = True, *, pinned: bool = False, keep_alive: str | float | None = None,
                  engine: dict[str, Any] | None = None) -> MultiModelBuilder:
        """`engine`: the model's engine settings (e.g. `{"backend": "vllm"}`)."""
        self._models.append((_entry(model_id, which, in_situ_quant, [], load, engine, pinned, keep_alive),
                             model_id is None))
        return self

    def add_model_with_alias(self, alias: str, which: Any, in_situ_quant: str | None = None,
                             load: bool = True, *, pinned: bool = False, keep_alive: str | float | None = None,
                             engine: dict[str, Any] | None = None) -> MultiModelBuilder:
        self._models.append((_entry(None, which, in_situ_quant, [alias], load, engine, pinned, keep_alive), True))
        return self

    def with_default_model(self, model: str) -> MultiModelBuilder:
        self._default = model
        return self

    def build(self, **runner_options: Any) -> Runner:
        return Runner(_models=self._models, _default=self._default, **runner_options)


def _public_error(exc: BaseException) -> BaseException:
    found = unwrap(exc)
    return found if isinstance(found, RayRunnerError) else exc


def _start_ray(address: str | None, log_level: str | int, attach_only: bool = False) -> bool:
    """Connect to Ray; returns True when this call started a new local cluster (the Runner then owns it).

    Without an address it joins only a cluster named by `RAY_ADDRESS` or started with `ray start`, never some
    other process's private cluster that `address="auto"` would find."""
    import ray

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
    existing = address or os.environ.get("RAY_ADDRESS") or ray_private.read_ray_address()
    if existing:
        ray.init(address=existing, **quiet)
        return False
    for name, value in CLUSTER_ENV.items():  # read by the raylet this starts: warm spare workers
        os.environ.setdefault(name, value)
    # Logical CPUs are placement slots, not cores: each model replica reserves `num_cpus` (0.125 by default) and the
    # busy engines share the real cores (`runtime.core_share`), so several Runners' models fit one small machine.
    ray.init(address="local", include_dashboard=True, num_cpus=CPU_SLOTS_PER_CORE * node_cores(), **quiet)
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
