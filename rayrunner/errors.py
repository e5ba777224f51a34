"""rayrunner's exceptions and the one place that maps each to an HTTP status and OpenAI error code.

Every exception is a `ValueError` subclass (mistral.rs's Python binding raises `ValueError`), carries a stable
`code`, and survives a trip through Ray (it is rebuilt from its message and code on the other side). What a caller
sees of any other failure is `client_error`'s: Ray's own text (node IPs, pids, actor ids) goes to the log only.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, ClassVar

logger = logging.getLogger(__name__)


class RayRunnerError(ValueError):
    """Base of every error rayrunner reports to a caller."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    type: ClassVar[str] = "server_error"
    retry_after_s: float | None = None  # when set, HTTP answers carry a `Retry-After` header

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param))

    def to_dict(self) -> dict[str, Any]:
        """The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(RayRunnerError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class InvalidSpecError(InvalidRequestError):
    code = "invalid_model_spec"


class UnsupportedRequestError(InvalidRequestError):
    """The model exists but does not serve this kind of request (e.g. chat on an embedding model)."""

    code = "unsupported_request"


class ModelNotFoundError(RayRunnerError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"

    def __init__(self, model_id: str, param: str | None = "model") -> None:
        super().__init__(f"model `{model_id}` was not found", param)
        self.model_id = model_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model_id, self.param))


class _ModelStateError(RayRunnerError):
    """A lifecycle operation that conflicts with the model's current state."""

    status = 409
    type = "invalid_request_error"
    template: ClassVar[str] = "model `{}`"

    def __init__(self, model_id: str, param: str | None = "model_id") -> None:
        super().__init__(self.template.format(model_id), param)
        self.model_id = model_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model_id, self.param))


class ModelAlreadyUnloadedError(_ModelStateError):
    code = "model_already_unloaded"
    template = "model `{}` is already unloaded"


class ModelAlreadyLoadedError(_ModelStateError):
    code = "model_already_loaded"
    template = "model `{}` is already loaded"


class ModelReloadingError(_ModelStateError):
    code = "model_reloading"
    template = "model `{}` is being reloaded"


class ModelExistsError(_ModelStateError):
    code = "model_exists"
    template = "model `{}` already exists"


class ModelRemovingError(_ModelStateError):
    code = "model_removing"
    template = "model `{}` is being removed"


class AliasConflictError(RayRunnerError):
    status = 409
    code = "alias_conflict"
    type = "invalid_request_error"


class AuthenticationError(RayRunnerError):
    """No API key, or one the service does not know (OpenAI's 401)."""

    status = 401
    code = "invalid_api_key"
    type = "invalid_request_error"


class PermissionDeniedError(RayRunnerError):
    """A valid key without the right: an inference key on an admin route, or a model source outside the allowed."""

    status = 403
    code = "permission_denied"
    type = "invalid_request_error"


class RequestTooLargeError(RayRunnerError):
    status = 413
    code = "request_too_large"
    type = "invalid_request_error"


class RequestTimeoutError(RayRunnerError):
    """The request ran past the service's `request_timeout_s`; its work was cancelled."""

    status = 408
    code = "request_timeout"
    type = "invalid_request_error"


class ModelLoadError(RayRunnerError):
    """Loading failed; the model is back to `unloaded` with `last_error` set."""

    status = 500
    code = "model_load_failed"

    def __init__(self, message: str, param: str | None = None) -> None:
        prefix = "failed to reload model: "
        super().__init__(message if message.startswith(prefix) else prefix + message, param)


class ModelTimeoutError(RayRunnerError):
    status = 503
    code = "model_timeout"


class EngineError(RayRunnerError):
    status = 500
    code = "engine_error"


class ModelUnavailableError(RayRunnerError):
    """The model's replica died or cannot take requests right now (e.g. it is restarting); retrying is safe."""

    status = 503
    code = "model_unavailable"

    def __init__(self, model_id: str | None = None, param: str | None = None) -> None:
        name = f"model `{model_id}`" if model_id else "the model"
        super().__init__(f"{name} is unavailable right now; retry", param)
        self.model_id = model_id

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model_id, self.param))


class ServerOverloadedError(RayRunnerError):
    """Too many requests queued: retry after `retry_after_s`. 429 rather than 503 because it is the status OpenAI
    uses for "slow down", which its SDKs retry (as they do 5xx) with a backoff that honours `Retry-After`."""

    status = 429
    code = "server_overloaded"

    def __init__(self, message: str = "the server is overloaded; retry later", retry_after_s: float = 1.0,
                 param: str | None = None) -> None:
        super().__init__(message, param)
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.retry_after_s, self.param))



class ModelTooLargeError(InvalidRequestError):
    """The model cannot fit under `max_loaded_bytes` even with every other model unloaded."""

    code = "model_too_large"


class UnplaceableModelError(InvalidRequestError):
    """No node of the cluster (nor any node type its autoscaler may add) could ever hold the model's replica."""

    code = "unplaceable_model"


class CapacityError(RayRunnerError):
    """No loaded model could be evicted (all pinned or busy) within the load timeout; retrying later may work."""

    status = 503
    code = "capacity_exhausted"
    retry_after_s = 5.0


class SpecMismatchError(ModelExistsError):
    """An add of a registered id with another spec; the message names each differing field, old and new."""

    def __init__(self, model_id: str, differences: str, param: str | None = "model_id") -> None:
        super().__init__(model_id, param)
        self.differences = differences
        self.message = f"model `{model_id}` already exists with a different spec ({differences})"
        self.args = (self.message,)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.model_id, self.differences, self.param))


class NoDefaultModelError(ModelNotFoundError):
    """`default` was asked for while none is set (its model was removed and none of the same kind was left)."""

    def __init__(self, model_id: str = "default", param: str | None = "model") -> None:
        super().__init__(model_id, param)
        self.message = "no default model is set; name a model, or set a default (POST /v1/models/default)"
        self.args = (self.message,)

def unwrap(exc: BaseException) -> BaseException:
    """Dig the original error out of Ray's wrappers. `RayTaskError(X)` subclasses X too, so its `.cause` (the
    original) is followed before any isinstance check."""
    current: BaseException = exc
    for _ in range(16):
        cause = getattr(current, "cause", None)
        if not isinstance(cause, BaseException):
            return current
        current = cause
    return current


def as_rayrunner_error(exc: BaseException) -> RayRunnerError:
    """Any exception as a RayRunnerError with its message kept, for records such as a model's `last_error`. What is
    sent to callers goes through `client_error` instead."""
    found = unwrap(exc)
    if isinstance(found, RayRunnerError):
        return found
    return EngineError(f"{type(found).__name__}: {found}")


def client_error(exc: BaseException, model_id: str | None = None) -> RayRunnerError:
    """What a caller may see of `exc`: rayrunner errors as they are; Ray's replica outages as ModelUnavailableError
    (503) and Serve's back-pressure as ServerOverloadedError (429), both retryable; anything else as a generic 500
    whose message holds only a reference to the log entry, where the full details go."""
    # Imported here: this module is also used where Ray is not needed.
    from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    found = unwrap(exc)
    if isinstance(found, RayRunnerError):
        return found
    if isinstance(found, BackPressureError):
        logger.warning("model %s is overloaded: %s", model_id, exc)
        return ServerOverloadedError(retry_after_s=found.retry_after_s or 1.0)
    outages = (RayActorError, WorkerCrashedError, NodeDiedError, DeploymentUnavailableError, ReplicaUnavailableError)
    if isinstance(found, outages):
        logger.warning("model %s is unavailable: %s", model_id, exc)
        return ModelUnavailableError(model_id)
    reference = uuid.uuid4().hex[:12]
    logger.error("unexpected error (reference %s) for model %s", reference, model_id, exc_info=exc)
    return RayRunnerError(f"internal error (reference {reference}); the details are in the server log")
