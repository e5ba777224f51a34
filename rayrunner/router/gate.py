"""What every HTTP request passes before a route runs: API keys and the body-size limit (an ASGI middleware), and
the per-request limits the routes apply (max tokens, timeout), all from the router's args.

API keys are optional. With `auth.api_keys` set (or `RAYRUNNER_API_KEYS`, comma-separated), every route but
`/health` and the docs needs `Authorization: Bearer <key>` (the OpenAI SDKs send it): 401 without a known key. The
admin routes (every `POST /v1/models/...` but `status`) need an admin key, from `auth.admin_api_keys` (or
`RAYRUNNER_ADMIN_API_KEYS`): 401 without a known key, 403 for an inference key; admin keys are accepted everywhere.
A service with inference keys and no admin keys has no admin API over HTTP: its admin routes answer 403 to every
known key. With no keys at all every route is open (`RegistryConfig.auth.check_http_host` refuses that beyond
loopback unless `auth.allow_open`). Keys are compared in constant time and never logged or echoed. Handle callers
(`DeploymentHandle`, `Runner`) are inside the cluster and pass no key: the admin API works for them either way.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, ClassVar

from rayrunner.errors import (
    AuthenticationError,
    PermissionDeniedError,
    RayRunnerError,
    RequestTooLargeError,
)
from rayrunner.registry.config import ApiKeys, RequestLimits

_OPEN_PATHS = {"/health", "/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc"}
_READ_ONLY_ADMIN = {"/v1/models/status"}
_NEEDS_KEY = "a valid API key is required (Authorization: Bearer <key>)"
_NEEDS_ADMIN_KEY = "an admin API key is required (Authorization: Bearer <key>)"
_NO_ADMIN_KEYS = ("this service has no admin API keys, so its admin API is off over HTTP (set auth.admin_api_keys "
                  "or RAYRUNNER_ADMIN_API_KEYS to turn it on; handles and Runner inside the cluster still work)")


def _known(key: str | None, keys: list[str]) -> bool:
    """Constant-time membership: every configured key is compared, whatever matches."""
    found = False
    for candidate in keys:
        found |= key is not None and hmac.compare_digest(key.encode(), candidate.encode())
    return found


def _is_admin_route(method: str, path: str) -> bool:
    return method == "POST" and path.startswith("/v1/models/") and path not in _READ_ONLY_ADMIN


class Gate:
    """ASGI middleware in front of the router's FastAPI app. `keys` and `limits` are the router's (one router per
    replica process; set by the Router at start)."""

    keys: ClassVar[ApiKeys] = ApiKeys()
    limits: ClassVar[RequestLimits] = RequestLimits()

    def __init__(self, app: Any) -> None:
        self.app = app

    @classmethod
    def configure(cls, keys: ApiKeys, limits: RequestLimits) -> None:
        cls.keys, cls.limits = keys.with_environment(), limits

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._authorize(scope)
            body = await self._read_body(scope, receive)
        except RayRunnerError as exc:
            await _send_error(send, exc)
            return
        if body is not None:
            await self.app(scope, _replay(body, receive), send)

    def _authorize(self, scope: dict[str, Any]) -> None:
        path, keys = scope["path"], self.keys
        if path in _OPEN_PATHS or not (keys.api_keys or keys.admin_api_keys):
            return
        key = _bearer(scope)
        if _known(key, keys.admin_api_keys):
            return
        if not _is_admin_route(scope["method"], path):
            if keys.api_keys and not _known(key, keys.api_keys):
                raise AuthenticationError(_NEEDS_KEY)
            return
        if not _known(key, keys.api_keys):
            raise AuthenticationError(_NEEDS_ADMIN_KEY if keys.admin_api_keys else _NEEDS_KEY)
        if not keys.admin_api_keys:
            raise PermissionDeniedError(_NO_ADMIN_KEYS)
        raise PermissionDeniedError("this key may not use the admin API (it needs an admin key)")

    async def _read_body(self, scope: dict[str, Any], receive: Any) -> bytes | None:
        """The whole body, refused past the limit (by its declared length at once, else as it arrives); None if
        the client went away meanwhile. Read here, not by the route, so the refusal is an OpenAI-shaped 413."""
        limit = self.limits.max_body_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _too_large(limit)
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Any) -> Any:
    """A `receive` that hands the route the body already read, then the client's later messages (a disconnect)."""
    pending = True

    async def replayed() -> dict[str, Any]:
        nonlocal pending
        if pending:
            pending = False
            return {"type": "http.request", "body": body, "more_body": False}
        message: dict[str, Any] = await receive()
        return message

    return replayed


def _too_large(limit: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body is larger than this service accepts ({limit} bytes)")


def _bearer(scope: dict[str, Any]) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


async def _send_error(send: Any, exc: RayRunnerError) -> None:
    body = json.dumps(exc.to_dict()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if exc.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
