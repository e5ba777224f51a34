"""The per-model Serve deployment: one replica holds one engine and answers OpenAI-shaped requests.

It returns plain dicts (and yields dicts when streaming); HTTP status codes and SSE framing are the router's job.
Errors raised here are rayrunner errors, which the router maps to OpenAI error bodies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import psutil
import ray
from ray import serve
from ray.serve import Application
from ray.serve.exceptions import RayServeException

from rayrunner.engines.base import Engine
from rayrunner.engines.factory import EngineFactory, build_engine
from rayrunner.engines.vllm.runtime import vllm_runtime_env
from rayrunner.errors import InvalidRequestError
from rayrunner.models.load_progress import for_model
from rayrunner.models.spec import EngineSettings, ModelSpec
from rayrunner.openai import replies
from rayrunner.openai.events import GenerationEvent
from rayrunner.openai.sampling_params import SamplingParams, sampling_params
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from rayrunner.runtime import logs, metrics, ray_private
from rayrunner.runtime.ready_batches import ready_batches
from rayrunner.runtime.warm_workers import REPLICA_RUNTIME_ENV

if TYPE_CHECKING:
    from rayrunner.replica.engine_slot import EngineSlot

DEPLOYMENT = "ModelServer"  # the deployment's name inside every model app


class ModelServer:
    """Serve replica class: constructed with a spec dict, holds the engine for the replica's lifetime."""

    def __init__(self, spec: dict[str, Any], engine_factory: EngineFactory = build_engine) -> None:
        # The engine stack (torch) is imported here, in the replica: the registry and the routers import this module
        # to deploy and call it, and stay free of torch.
        from rayrunner.replica.engine_slot import EngineSlot

        logs.to_replica_log()
        self.spec = ModelSpec.model_validate(spec)
        self.engine_factory = engine_factory
        _set_torch_threads(self.spec.engine)
        self.slot: EngineSlot = EngineSlot(self._build_engine, self.spec.app_name)
        self.started_at = time.time()
        self.requests_served = 0  # generation requests this replica took (how Serve spreads them over replicas)
        self.sequences = 0  # sequences of the requests it is serving now, running or waiting for a slot
        self.serving: dict[str, int] = {}  # those requests by Serve request id -> sequences (its routing stats)
        self.replica_id = _replica_id()

    def _build_engine(self) -> Engine:
        """The engine, built at start (and again by a wake whose parked weights are lost); the load progress it
        reported ends at `ready`."""
        engine = self.engine_factory(self.spec)
        for_model(self.spec.app_name, self.spec.model_id).ready()
        return engine

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        request = ChatCompletionRequest.model_validate(body)
        async with self._serving(request) as engine:
            tools = engine.tool_replies(request)
            adapter = await _request_adapter(engine, body)
            events = self._measured(engine.chat(request, self._params(request), adapter))
            return (await replies.chat_response(adapter or self.spec.model_id, events, request, tools)).model_dump()

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        """The reply's chunks, in batches of those ready together (`ready_batches`): one message each to the router."""
        request = ChatCompletionRequest.model_validate(body)
        async with self._serving(request) as engine:
            tools = engine.tool_replies(request)
            adapter = await _request_adapter(engine, body)
            events = self._measured(engine.chat(request, self._params(request), adapter))
            async for batch in ready_batches(replies.chat_chunks(adapter or self.spec.model_id, events, request,
                                                                   tools)):
                yield [chunk.model_dump(exclude_none=True) for chunk in batch]

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        request = CompletionRequest.model_validate(body)
        async with self._serving(request) as engine:
            adapter = await _request_adapter(engine, body)
            events = self._measured(engine.complete(request, self._params(request), adapter))
            return (await replies.completion_response(adapter or self.spec.model_id, events, request)).model_dump()

    async def complete_stream(self, body: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        request = CompletionRequest.model_validate(body)
        async with self._serving(request) as engine:
            adapter = await _request_adapter(engine, body)
            events = self._measured(engine.complete(request, self._params(request), adapter))
            async for batch in ready_batches(replies.completion_chunks(adapter or self.spec.model_id, events,
                                                                         request)):
                yield [chunk.model_dump(exclude_none=True) for chunk in batch]

    def _params(self, request: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
        return sampling_params(request, self.spec.engine)

    @contextlib.asynccontextmanager
    async def _serving(self, request: ChatCompletionRequest | CompletionRequest) -> AsyncIterator[Engine]:
        """The engine for one generation request; its `n` sequences count in this replica's load meanwhile."""
        sequences, request_id = request.n or 1, _request_id()
        self.requests_served += 1
        self.sequences += sequences
        self.serving[request_id] = sequences
        try:
            async with self.slot.use() as engine:
                yield engine
        finally:
            self.sequences -= sequences
            self.serving.pop(request_id, None)  # an id twice at once (one parent's two calls) must not fail it

    async def _measured(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        """The engine's events, each finished choice's figures recorded (`rayrunner.runtime.metrics.generation`)."""
        async for event in events:
            if event.finish_reason is not None:
                metrics.generation(self.spec.model_id, event)
            yield event

    def record_routing_stats(self) -> dict[str, Any]:
        """This replica's load for Serve's request router (`rayrunner.router.replica_choice`), every second: the
        requests it serves by id, so the router tells which of its own it counts; also its
        `rayrunner_replica_sequences` gauge."""
        metrics.replica_sequences(self.spec.model_id, self.replica_id, self.sequences)
        return {"requests": dict(self.serving)}

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        request = EmbeddingRequest.model_validate(body)
        async with self.slot.use() as engine:
            result = await engine.embed(request.texts())
        return replies.embedding_response(self.spec.model_id, result, request.encoding_format).model_dump()

    async def sleep(self) -> dict[str, Any]:
        """Park the weights and free them, keep the engine (`unload` with mode `sleep`); the next request or `wake`
        puts them back (`rayrunner.replica.engine_slot`)."""
        await self.slot.sleep(self.spec.engine.graceful_shutdown_timeout_s)
        return self.info()

    async def wake(self) -> dict[str, Any]:
        await self.slot.wake()
        return self.info()

    def check_health(self) -> None:
        """Serve's periodic health check: a wedged or dead engine fails it (asleep or awake)."""
        self.slot.engine.check_health()

    def info(self) -> dict[str, Any]:
        """What this replica loaded (nothing while asleep), its sleep state, pid, interpreter and start time."""
        loaded = {} if self.slot.asleep else dataclasses.asdict(self.slot.engine.info())
        return {**loaded, **self.slot.state(), "pid": os.getpid(), "python": sys.executable,
                "started_at": self.started_at, "requests_served": self.requests_served, "sequences": self.sequences,
                "process_rss_bytes": _rss_bytes()}

    def worker(self) -> dict[str, Any]:
        """What a spare worker for the next replica must match (`warm_workers`): this replica's node, job and
        serialized runtime env (it may hold environment values: never stored or shown), and its process start."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "job_id": context.get_job_id(),
                "runtime_env": context.get_runtime_env_string(), "process_started_at": psutil.Process().create_time()}

    def __del__(self) -> None:
        slot = getattr(self, "slot", None)
        if slot is not None:
            slot.close()


async def _request_adapter(engine: Engine, body: dict[str, Any]) -> str | None:
    """The LoRA adapter the body names in `adapter` (the router sets it for a LoRA model id), first loaded from
    `adapter_source` (folder or hub id) when this replica does not hold it yet: after a restart, or after a wake
    that had to load the model again."""
    name, source = body.get("adapter"), body.get("adapter_source")
    if name is None:
        return None
    if not isinstance(name, str) or not isinstance(source, str | None):
        raise InvalidRequestError("`adapter` and `adapter_source` must be strings", param="adapter")
    await engine.use_adapter(name, source)
    return name


def _replica_id() -> str:
    """This Serve replica's id (`-` for a server built outside Serve, as unit tests do)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except RayServeException:
        return "-"


def _request_id() -> str:
    """The Serve request id the router saw for this request (a fresh one outside Serve, as unit tests run it)."""
    return ray_private.serve_request_id() or uuid.uuid4().hex


def _rss_bytes() -> int | None:
    """The replica process's resident memory (what a sleeping model still holds), where /proc tells it."""
    try:
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _set_torch_threads(settings: EngineSettings) -> None:
    import torch

    threads = settings.torch_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)


def model_deployment(spec: ModelSpec, version: str | None = None) -> Application:
    """The Serve application of one model: its `ModelServer` deployment, with the replicas and placement of the
    spec's settings. A deploy with the `version` of the running one changes only what Serve changes in place (the
    replica count, routing): no replica restarts. None: a new version (Serve's default), every replica new."""
    settings = spec.engine
    deployment = serve.deployment(
        name=DEPLOYMENT,
        **settings.serve_options(),
        max_ongoing_requests=settings.replica_max_ongoing_requests(),
        graceful_shutdown_timeout_s=settings.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=0.5,
        max_constructor_retry_count=1,  # a broken model does not heal by retrying; fail fast instead
        ray_actor_options={**settings.ray_actor_options(), "runtime_env": _runtime_env(settings)},
    )(ModelServer)
    if version is not None:
        deployment = ray_private.with_code_version(deployment, version)
    return deployment.bind(spec.replica_args())


def _runtime_env(settings: EngineSettings) -> dict[str, Any]:
    """vLLM's interpreter for the vllm backend (`vllm_runtime`); otherwise RAYRUNNER_PRELOAD: the worker imports
    the model stack as it starts (see rayrunner.runtime.warm_workers)."""
    return vllm_runtime_env(settings) if settings.backend == "vllm" else REPLICA_RUNTIME_ENV


def build_model_app(args: dict[str, Any]) -> Application:
    """Application builder for config files: `import_path: rayrunner.replica.model_server:build_model_app`,
    with the model's spec (`model_id`, `which`, `in_situ_quant`, `engine`) as `args` (invalid ones:
    `app_args.builder_args`)."""
    from rayrunner.runtime.app_args import builder_args

    spec = builder_args(ModelSpec, args, "model spec")
    return model_deployment(spec)
