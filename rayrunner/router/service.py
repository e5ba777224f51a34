"""What the router does, independent of HTTP: resolve a model name, make sure it is loaded, call its deployment.

Both faces of the router use it: the FastAPI routes (HTTP) and the deployment's Python methods (handles). Every
request is counted open from its start to its last item (`UsageTracker`), which tells the registry what is in use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, Literal, TypeVar

from ray import serve
from ray.serve.handle import DeploymentHandle

from rayrunner.errors import ModelUnavailableError, UnsupportedRequestError, client_error
from rayrunner.registry import model_apps
from rayrunner.registry.actor import get_registry
from rayrunner.registry.config import RegistryConfig
from rayrunner.router.routes import RoutingTable
from rayrunner.router.usage import UsageTracker
from rayrunner.runtime.transport import direct

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often a request stuck behind a zero-replica deployment re-checks whether its model needs a reload.
_WATCH_S = 2.0
_GENERATES = {"text", "multimodal"}
# Registry operations that change routes: after one, this replica re-reads the table before answering.
# The methods called by name across a Ray boundary, as types: mypy checks every call site, and
# tests/router/test_typed_calls.py that each still names a method of `ModelServer` or `Registry`.
ModelCall = Literal["chat", "complete", "embed"]
ModelStream = Literal["chat_stream", "complete_stream"]
RegistryCall = Literal["cards", "card", "status", "default_id", "unload", "reload", "add", "remove", "set_default",
                       "add_alias", "set_pinned", "scale"]
_MUTATIONS: frozenset[RegistryCall] = frozenset({"unload", "reload", "add", "remove", "set_default", "add_alias"})


class RouterService:
    def __init__(self, config: RegistryConfig, app_name: str) -> None:
        self.config = config
        self.registry = get_registry(app_name, config.state_path)
        self.routes = RoutingTable(self.registry)
        self.usage = UsageTracker(self.registry)
        self._handles: dict[str, DeploymentHandle] = {}

    async def start(self) -> None:
        await self.registry.bootstrap.remote(self.config.model_dump(mode="json"))
        await self.routes.refresh()
        self.routes.start()

    # ------------------------------------------------------------ inference

    async def call(self, name: str, method: ModelCall, body: dict[str, Any], kinds: set[str]) -> dict[str, Any]:
        """Unary call of `method` on the model named `name`, reloading it first if it is unloaded."""
        target = await self._target(name, kinds)
        serving = _serving_id(target)
        with self._open(serving, body):
            await self._loaded(target)
            handle = self._handle(target["app_name"])
            try:
                result: dict[str, Any] = await self._guard(getattr(handle, method).remote(_for(target, body)), serving)
            except ModelUnavailableError:  # its replica died: nothing reached the caller, so another one answers
                logger.info("`%s`: a replica died under a %s request; sending it again", serving, method)
                result = await self._guard(getattr(handle, method).remote(_for(target, body)), serving)
        return result

    async def stream(self, name: str, method: ModelStream, body: dict[str, Any], kinds: set[str]) -> AsyncIterator[Any]:
        """Streaming call. The first item is awaited before returning, so errors surface before any output. The
        request counts as open until the stream ends, or is dropped unread."""
        target = await self._target(name, kinds)
        model_id = _serving_id(target)
        self.usage.begin(model_id, body.get("keep_alive"))
        close = _once(lambda: self.usage.end(model_id))
        try:
            await self._loaded(target)
            handle = self._handle(target["app_name"]).options(stream=True)
            try:
                generator, first = await self._first(handle, method, _for(target, body), model_id)
            except ModelUnavailableError:  # its replica died before the first chunk: another one streams it
                logger.info("`%s`: a replica died before a %s stream began; starting it again", model_id, method)
                generator, first = await self._first(handle, method, _for(target, body), model_id)
        except BaseException:
            close()
            raise
        stream = _prepend(first, generator, model_id, close)
        weakref.finalize(stream, close)
        return stream

    async def _first(self, handle: DeploymentHandle, method: ModelStream, body: dict[str, Any], model_id: str
                     ) -> tuple[Any, Any]:
        """A model stream and its first item (None for an empty stream); the stream is cancelled if that fails."""
        generator = getattr(handle, method).remote(body)
        try:
            return generator, await self._guard(generator.__anext__(), model_id)
        except StopAsyncIteration:
            return generator, None
        except BaseException:
            generator.cancel()
            raise

    def model_label(self, name: str) -> str:
        """The model id `name` routes to, for metrics: `unknown` for names that route nowhere (no label growth)."""
        route = self.routes.get(name)
        return str(route["model_id"]) if route is not None else "unknown"

    @contextlib.contextmanager
    def _open(self, model_id: str, body: dict[str, Any]) -> Iterator[None]:
        self.usage.begin(model_id, body.get("keep_alive"))
        try:
            yield
        finally:
            self.usage.end(model_id)

    async def _target(self, name: str, kinds: set[str]) -> dict[str, Any]:
        target: dict[str, Any] = self.routes.get(name) or await self.registry.resolve.remote(name)
        if target["kind"] not in kinds:
            wanted = "embeddings" if kinds == {"embedding"} else "generation"
            raise UnsupportedRequestError(
                f"model `{target['model_id']}` is {_article(target['kind'])} {target['kind']} model and does not "
                f"serve {wanted}",
                param="model",
            )
        return target

    async def _loaded(self, target: dict[str, Any]) -> None:
        if target["status"] != "loaded":
            await self.registry.ensure_loaded.remote(_serving_id(target))

    async def _status(self, model_id: str) -> str:
        """From the followed routing table (no registry call), unless this replica has no copy of it right now."""
        route = self.routes.get(model_id)
        return str(route["status"]) if route is not None else str(await self.registry.status.remote(model_id))

    def _handle(self, app: str) -> DeploymentHandle:
        if app not in self._handles:
            self._handles[app] = direct(serve.get_deployment_handle(model_apps.DEPLOYMENT, app_name=app))
        return self._handles[app]

    async def _guard(self, awaitable: Awaitable[T], model_id: str) -> T:
        """Await a model call; if the model was unloaded under it (the request then waits for a replica that
        will not come on its own), trigger the reload it is waiting for. Failures come out as `client_error`s."""
        task = asyncio.ensure_future(awaitable)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=_WATCH_S)
                if done:
                    return task.result()
                if await self._status(model_id) == "unloaded":
                    await self.registry.ensure_loaded.remote(model_id)
        except asyncio.CancelledError:
            task.cancel()
            raise
        except Exception as exc:
            raise client_error(exc, model_id) from None

    # ------------------------------------------------------------ admin

    async def admin(self, operation: RegistryCall, *args: Any) -> Any:
        """Forward a registry operation (cards, unload, reload, add, remove, set_default, add_alias, ...)."""
        try:
            return await getattr(self.registry, operation).remote(*args)
        finally:
            if operation in _MUTATIONS:  # even a failed one may have changed a status (e.g. a failed reload)
                with contextlib.suppress(Exception):  # if the registry is unreachable, the follower catches up
                    await self.routes.refresh()


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _serving_id(target: dict[str, Any]) -> str:
    """The model whose replica answers: the target itself, or a LoRA model's host."""
    return str(target.get("serving_id") or target["model_id"])


def _for(target: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """The body for the serving replica: a LoRA model's requests name its adapter and where to load it from."""
    if "adapter" not in target:
        return body
    return {**body, "adapter": target["adapter"], "adapter_source": target["adapter_source"]}


async def _prepend(first: Any, rest: Any, model_id: str, close: Callable[[], None]) -> AsyncIterator[Any]:
    try:
        if first is not None:
            yield first
        async for item in rest:
            yield item
    except Exception as exc:
        raise client_error(exc, model_id) from None
    finally:
        rest.cancel()
        close()


def _once(action: Callable[[], None]) -> Callable[[], None]:
    """`action`, run on the first call only (a stream is closed by its end or, if never read, by its collection)."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run
