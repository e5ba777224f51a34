"""The router deployment: FastAPI ingress at `/` for the OpenAI and admin APIs, plus Python methods for handles.

Route functions take their body already validated (declared as the protocol's models, so `/openapi.json` describes
them), delegate to `RouterService`, and shape JSON or SSE; every error becomes an OpenAI error body through
`rayrunner.errors.client_error`, which keeps Ray's internals out of it.
"""


import json
import math
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from ray import serve
from ray.serve import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayrunner.errors import InvalidRequestError, RayRunnerError, client_error
from rayrunner.protocol import (
    AddModelBody,
    AliasBody,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ErrorResponse,
    ModelIdBody,
    ScaleBody,
    UnloadBody,
)
from rayrunner.registry.config import RegistryConfig
from rayrunner.router import cards, timeouts
from rayrunner.router.gate import Gate
from rayrunner.router.responses_api import ResponsesRequest, event_frames, stream_events, to_chat_request, to_response
from rayrunner.router.service import _GENERATES, ModelCall, ModelStream, RegistryCall, RouterService
from rayrunner.runtime import logs, metrics, ray_private
from rayrunner.runtime.app_args import builder_args
from rayrunner.runtime.ready_batches import ready_batches
from rayrunner.runtime.warm_workers import ROUTER_RUNTIME_ENV

B = TypeVar("B", bound=BaseModel)
ROUTER_NUM_CPUS = 0.1  # the router replica's placement slot (it waits on the network, the engines compute)
# "default" documents the error shape of every route (and keeps FastAPI from advertising a 422 it never sends);
# a body sent without a content-type is read as JSON, as before bodies were declared.
api = FastAPI(
    title="rayrunner",
    description="Many models behind one OpenAI-compatible endpoint.",
    responses={"default": {"model": ErrorResponse, "description": "An OpenAI-shaped error (4xx or 5xx)."}},
    strict_content_type=False,
)


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI error body with the error's status, and `Retry-After` (whole seconds) when it says when to retry."""
    error = client_error(exc)
    headers = None if error.retry_after_s is None else {"Retry-After": str(math.ceil(error.retry_after_s))}
    return JSONResponse(error.to_dict(), status_code=error.status, headers=headers)


async def _error(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(_invalid(exc.errors()))


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's and Starlette's own refusals (an unknown route, a wrong method, a body that is not UTF-8) in the
    OpenAI shape, with their status."""
    error = InvalidRequestError(_HTTP_MESSAGES.get(exc.status_code, str(exc.detail)))
    return JSONResponse(error.to_dict(), status_code=exc.status_code, headers=exc.headers)


_HTTP_MESSAGES = {400: "the request body could not be read (it must be UTF-8 JSON)", 404: "no such route",
                  405: "this route does not take that HTTP method"}


def add_error_handlers(app: FastAPI) -> None:
    """Every failure as an OpenAI error body; an invalid body is a 400 (never FastAPI's 422 shape)."""
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RayRunnerError, _error)
    app.add_exception_handler(Exception, _error)  # the rest: a 500 without internals


add_error_handlers(api)
api.add_middleware(Gate)  # API keys and the body-size limit, before any route


_UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _invalid(errors: Any) -> InvalidRequestError:
    first = errors[0]
    if first["type"] == "json_invalid":
        return InvalidRequestError("the request body is not valid JSON")
    # pydantic names the member of a union it tried (`str`, `list[...]`, `tagged-union[...]`): not the client's business
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and "[" not in str(p) and p not in _UNION_MEMBERS]
    message = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] in ("model_attributes_type", "model_type", "dict_type") and not loc:
        return InvalidRequestError(f"the request body must be a JSON object, sent as application/json ({message})")
    if not loc:  # a check across fields
        return InvalidRequestError(message)
    return InvalidRequestError(f"{'.'.join(loc)}: {message}", param=loc[0])


def parsed(model: type[B], body: dict[str, Any]) -> B:
    """A handle caller's body checked like an HTTP one: invalid input is an InvalidRequestError."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc.errors()) from None


def validated(model: type[B], body: dict[str, Any]) -> dict[str, Any]:
    """`parsed`, as the dict a model deployment takes."""
    return parsed(model, body).model_dump()


def sse(batches: AsyncIterator[list[dict[str, Any]]]) -> StreamingResponse:
    """Server-sent events of the model's chunks: what is ready together leaves in one write (one message to the
    proxy), each chunk its own `data:` event as clients expect."""

    async def frames() -> AsyncIterator[str]:
        try:
            async for ready in ready_batches(batches):
                yield "".join(f"data: {json.dumps(item)}\n\n" for batch in ready for item in batch)
        except Exception as exc:  # headers are sent already: report the error in-band, then end the stream
            yield f"data: {json.dumps(client_error(exc).to_dict())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(frames(), media_type="text/event-stream")


async def chunks_of(batches: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """A model stream's chunks one by one (the replica sends them in batches)."""
    async for batch in batches:
        for chunk in batch:
            yield chunk


async def _counted(model: str, method: str, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """`stream`, counted once when it ends: 200, the status of the error that ended it, or 499 if the client left.
    (Above the Router class: Serve pickles the ingress class when it is decorated, with the globals defined then.)"""
    status = 499
    try:
        async for item in stream:
            yield item
        status = 200
    except Exception as exc:
        error = client_error(exc, model)  # converted once here: `sse` then reports it as it is
        status = error.status
        raise error from None
    finally:
        metrics.request(model, method, status)


@serve.deployment(name="Router", max_ongoing_requests=256,
                  ray_actor_options={"num_cpus": ROUTER_NUM_CPUS, "runtime_env": ROUTER_RUNTIME_ENV})
@serve.ingress(api)
class Router:
    async def __init__(self, config: dict[str, Any]) -> None:  # type: ignore[misc]  # Serve awaits it
        """Bootstrap the registry at deploy time: a bad config fails the deploy (DEPLOY_FAILED, with the reason),
        and `load: true` models start loading before any request."""
        logs.to_replica_log()
        app_name = serve.get_replica_context().app_name
        checked = RegistryConfig.model_validate(config)
        checked.auth.check_http_host(await ray_private.serve_http_host())  # no open service beyond loopback
        self.service = RouterService(checked, app_name)
        Gate.configure(checked.auth, checked.limits)
        await self.service.start()

    # ------------------------------------------------------------ OpenAI API (HTTP)

    @api.post("/v1/chat/completions")
    async def http_chat(self, body: ChatCompletionRequest) -> Any:
        if body.stream:
            return sse(await self._open_stream("chat_stream", body.model_dump()))
        return await self._infer("chat", body.model_dump(), _GENERATES)

    @api.post("/v1/completions")
    async def http_complete(self, body: CompletionRequest) -> Any:
        if body.stream:
            return sse(await self._open_stream("complete_stream", body.model_dump()))
        return await self._infer("complete", body.model_dump(), _GENERATES)

    @api.post("/v1/embeddings")
    async def http_embed(self, body: EmbeddingRequest) -> Any:
        return await self._infer("embed", body.model_dump(), {"embedding"})

    @api.post("/v1/responses")
    async def http_responses(self, body: ResponsesRequest) -> Any:
        if body.stream:
            return StreamingResponse(event_frames(await self._response_events(body)), media_type="text/event-stream")
        return await self._respond(body)

    @api.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    # ------------------------------------------------------------ admin API (HTTP)

    @api.get("/v1/models")
    async def http_list(self) -> dict[str, Any]:
        return {"object": "list", "data": [cards.model_object(c) for c in await self.list_models()]}

    @api.get("/v1/models/default")
    async def http_default(self) -> dict[str, Any]:
        return cards.model_object(await self.model_card("default"))

    @api.get("/v1/models/{model:path}")
    async def http_card(self, model: str) -> dict[str, Any]:
        return cards.model_object(await self.model_card(model))

    @api.post("/v1/models/status")
    async def http_status(self, body: ModelIdBody) -> dict[str, Any]:
        return {"model_id": body.model_id, "status": await self.get_model_status(body.model_id)}

    @api.post("/v1/models/unload")
    async def http_unload(self, body: UnloadBody) -> dict[str, Any]:
        return cards.status_of(await self.unload_model(body.model_id, body.mode))

    @api.post("/v1/models/reload")
    async def http_reload(self, body: ModelIdBody) -> dict[str, Any]:
        return cards.status_of(await self.reload_model(body.model_id))

    @api.post("/v1/models/add", status_code=201,
              responses={200: {"description": "The same model was registered already: attached to it."}})
    async def http_add(self, body: AddModelBody, response: Response) -> dict[str, Any]:
        """201 when this call registered the model; 200 when it attached to the same one, already registered."""
        card = await self.add_model(body.model_dump())
        if card["attached"]:
            response.status_code = 200
        return cards.model_object(card)

    @api.post("/v1/models/remove")
    async def http_remove(self, body: ModelIdBody) -> dict[str, Any]:
        return await self.remove_model(body.model_id)

    @api.post("/v1/models/default")
    async def http_set_default(self, body: ModelIdBody) -> dict[str, Any]:
        return cards.model_object(await self.set_default_model_id(body.model_id))

    @api.post("/v1/models/aliases")
    async def http_alias(self, body: AliasBody) -> dict[str, Any]:
        return cards.model_object(await self.add_alias(body.model_id, body.alias))

    @api.post("/v1/models/pin")
    async def http_pin(self, body: ModelIdBody) -> dict[str, Any]:
        return cards.model_object(await self.pin_model(body.model_id))

    @api.post("/v1/models/scale")
    async def http_scale(self, body: ScaleBody) -> dict[str, Any]:
        return cards.model_object(await self.scale_model(body.model_id, body.changes()))

    @api.post("/v1/models/unpin")
    async def http_unpin(self, body: ModelIdBody) -> dict[str, Any]:
        return cards.model_object(await self.unpin_model(body.model_id))

    # ------------------------------------------------------------ Python API (DeploymentHandle)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._infer("chat", validated(ChatCompletionRequest, body), _GENERATES)

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Streaming chat for handles: call with `handle.options(stream=True).chat_stream.remote(body)`."""
        async for chunk in chunks_of(await self._open_stream("chat_stream", validated(ChatCompletionRequest, body))):
            yield chunk

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._infer("complete", validated(CompletionRequest, body), _GENERATES)

    async def complete_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        async for chunk in chunks_of(await self._open_stream("complete_stream", validated(CompletionRequest, body))):
            yield chunk

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._infer("embed", validated(EmbeddingRequest, body), {"embedding"})

    async def responses(self, body: dict[str, Any]) -> dict[str, Any]:
        """The Responses API (`POST /v1/responses`'s body): a Response object."""
        return await self._respond(parsed(ResponsesRequest, body))

    async def responses_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Responses streaming events for handles: `handle.options(stream=True).responses_stream.remote(body)`."""
        async for event in await self._response_events(parsed(ResponsesRequest, {**body, "stream": True})):
            yield event

    async def _respond(self, request: ResponsesRequest) -> dict[str, Any]:
        chat = await self._infer("chat", validated(ChatCompletionRequest, to_chat_request(request)), _GENERATES)
        return to_response(chat, request)

    async def _response_events(self, request: ResponsesRequest) -> AsyncIterator[dict[str, Any]]:
        """The stream's events, its first chunk already received (so errors before any output keep their status)."""
        chat = validated(ChatCompletionRequest, to_chat_request(request))
        return stream_events(chunks_of(await self._open_stream("chat_stream", chat)), request)

    async def _infer(self, method: ModelCall, body: dict[str, Any], kinds: set[str]) -> dict[str, Any]:
        limits = self.service.config.limits
        try:
            if kinds == _GENERATES:
                body = limits.bounded(body)
            async with timeouts.within(limits.request_timeout_s):
                result = await self.service.call(body["model"], method, body, kinds)
        except Exception as exc:
            raise self._refused(method, body, exc) from None
        metrics.request(self.service.model_label(body["model"]), method, 200)
        return result

    async def _open_stream(self, method: ModelStream, body: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        """The model's stream of chunk batches, its first already received (errors surface here, before any
        output)."""
        limits = self.service.config.limits
        deadline = timeouts.deadline(limits.request_timeout_s)
        try:
            body = limits.bounded(body)
            async with timeouts.within(limits.request_timeout_s):
                stream = await self.service.stream(body["model"], method, body, _GENERATES)
        except Exception as exc:
            raise self._refused(method, body, exc) from None
        return _counted(self.service.model_label(body["model"]), method, timeouts.until(deadline, stream))

    def _refused(self, method: str, body: dict[str, Any], exc: Exception) -> RayRunnerError:
        """What the caller gets for a request that failed before any output, counted with its status."""
        error = client_error(exc, body["model"])
        metrics.request(self.service.model_label(body["model"]), method, error.status)
        return error

    async def list_models(self) -> list[dict[str, Any]]:
        return await self._admin("cards")

    async def model_card(self, model: str) -> dict[str, Any]:
        return await self._admin("card", model)

    async def get_model_status(self, model: str) -> str:
        return await self._admin("status", model)

    async def get_default_model_id(self) -> str | None:
        return await self._admin("default_id")

    async def unload_model(self, model: str, mode: str = "stop") -> dict[str, Any]:
        """`mode`: `stop` (no replica left) or `sleep` (the replica stays, its weights freed)."""
        return await self._admin("unload", model, parsed(UnloadBody, {"model_id": model, "mode": mode}).mode)

    async def reload_model(self, model: str) -> dict[str, Any]:
        return await self._admin("reload", model)

    async def add_model(self, body: dict[str, Any]) -> dict[str, Any]:
        """Body as for `POST /v1/models/add`: model_id, which, in_situ_quant, aliases, load, engine."""
        return await self.add_model_entry(cards.entry_from_add(AddModelBody.model_validate(body)))

    async def add_model_entry(self, entry: dict[str, Any]) -> dict[str, Any]:
        """A registry entry: {"spec": ModelSpec, "aliases": [...], "load": bool}."""
        return await self._admin("add", entry)

    async def remove_model(self, model: str) -> dict[str, Any]:
        return await self._admin("remove", model)

    async def set_default_model_id(self, model: str) -> dict[str, Any]:
        return await self._admin("set_default", model)

    async def add_alias(self, model: str, alias: str) -> dict[str, Any]:
        return await self._admin("add_alias", model, alias)

    async def pin_model(self, model: str) -> dict[str, Any]:
        """Never evict the model to make room for another (its keep_alive still applies); kept across restarts."""
        return await self._admin("set_pinned", model, True)

    async def unpin_model(self, model: str) -> dict[str, Any]:
        return await self._admin("set_pinned", model, False)

    async def scale_model(self, model: str, changes: dict[str, Any]) -> dict[str, Any]:
        """New replica settings (`num_replicas` or `autoscaling_config`, `routing`); a loaded model rescales in
        place, restarting no replica."""
        return await self._admin("scale", model, changes)

    async def _admin(self, operation: RegistryCall, *args: Any) -> Any:
        try:
            return await self.service.admin(operation, *args)
        except Exception as exc:
            raise client_error(exc) from None


def build_router_app(args: dict[str, Any]) -> Application:
    """Application builder for config files: `import_path: rayrunner.router.app:build_router_app`, with a
    `RegistryConfig` (models, default_model, state_path, timeouts) as `args` (invalid ones: `builder_args`)."""
    config = builder_args(RegistryConfig, args, "router config")
    return Router.bind(config.model_dump(mode="json"))  # type: ignore[attr-defined]
