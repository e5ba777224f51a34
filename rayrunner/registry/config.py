"""The service's config, the router's `args`: every model it serves, the default, capacity limits, where models may
load from, request limits and API keys. Validated when a config is applied; the registry keeps the models part."""

from __future__ import annotations

import ipaddress
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayrunner.errors import InvalidRequestError
from rayrunner.models.source_policy import SourcePolicy
from rayrunner.registry.state import ModelEntry, RegistryState, UnloadMode


class ApiKeys(BaseModel):
    """The router's `auth`: who may call which routes, and whether the service may serve beyond loopback open."""

    model_config = ConfigDict(extra="forbid")
    api_keys: list[str] = Field(default_factory=list, description="Keys for the inference routes (and reads), "
                                "plus `RAYRUNNER_API_KEYS` (comma-separated). Set without `admin_api_keys`, the "
                                "admin routes are off over HTTP (403).")
    admin_api_keys: list[str] = Field(default_factory=list, description="Keys for the admin routes (and all), plus "
                                      "`RAYRUNNER_ADMIN_API_KEYS` (comma-separated).")
    allow_open: bool = Field(False, description="Serve with no keys at all on an HTTP host other machines can "
                             "reach (`0.0.0.0`, `::`, a non-loopback address): anyone who reaches it may then add, "
                             "remove, unload and scale models. Off: such a service refuses to start.")

    def with_environment(self) -> ApiKeys:
        """These keys plus `RAYRUNNER_API_KEYS` / `RAYRUNNER_ADMIN_API_KEYS` (comma-separated)."""
        return ApiKeys(api_keys=self.api_keys + _env_keys("RAYRUNNER_API_KEYS"),
                       admin_api_keys=self.admin_api_keys + _env_keys("RAYRUNNER_ADMIN_API_KEYS"),
                       allow_open=self.allow_open)

    def check_http_host(self, host: str | None) -> None:
        """Refuse an HTTP bind other machines can reach when no key (here or in the environment) guards it and
        `allow_open` is off. `host` None: Serve runs no HTTP proxy."""
        keys = self.with_environment()
        if host is None or self.allow_open or keys.api_keys or keys.admin_api_keys or is_loopback(host):
            return
        raise InvalidRequestError(
            f"HTTP host `{host}` is reachable from other machines and no API keys are set, so anyone who reaches "
            "it could add, remove, unload and scale models: set auth.admin_api_keys (or RAYRUNNER_ADMIN_API_KEYS), "
            "bind 127.0.0.1, or set auth.allow_open: true to serve it open on purpose", param="auth.allow_open")


def is_loopback(host: str) -> bool:
    """Whether an HTTP bind host is reachable only from this machine: `localhost`, 127.0.0.0/8, `::1`. A name
    other than `localhost` may resolve to any address, so it counts as reachable."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class RequestLimits(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_body_bytes: int = Field(32 * 2**20, ge=1024, description="Largest request body (413 past it).")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens one request may generate: a larger "
                                   "`max_tokens` is a 400, an unset one gets this (default: no limit).")
    request_timeout_s: float | None = Field(None, gt=0, description="Longest a request may run; past it, a 408 "
                                            "(a stream ends with that error) and its work is cancelled.")

    def bounded(self, body: dict[str, Any]) -> dict[str, Any]:
        """A generation body within `max_tokens`: refused above it, given it when it sets none."""
        if self.max_tokens is None:
            return body
        asked = body.get("max_tokens")
        if asked is None:
            return {**body, "max_tokens": self.max_tokens}
        if asked > self.max_tokens:
            raise InvalidRequestError(f"max_tokens: {asked} is more than this service allows per request "
                                      f"({self.max_tokens})", param="max_tokens")
        return body


def _env_keys(name: str) -> list[str]:
    return [key.strip() for key in os.environ.get(name, "").split(",") if key.strip()]



class RegistryConfig(BaseModel):
    """The router's `args`: every model it serves, the default, and where the registry keeps its state."""

    model_config = ConfigDict(extra="forbid")
    models: list[ModelEntry] = Field(default_factory=list, description="The models declared; more may be added at "
                                     "runtime, and the config wins for the ones it declares.")
    default_model: str | None = Field(None, description="Model id or alias that `default` (and a request without "
                                      "`model`) goes to; default: the first model.")
    state_path: str | None = Field(None, description="Registry state file (default: `registry.json`, "
                                   "`registry-<app>.json` for a router app not named `rayrunner`, in "
                                   "`$RAYRUNNER_CACHE_DIR`, else `~/.cache/rayrunner`); on a cluster, storage every "
                                   "node reaches.")
    load_timeout_s: float = Field(900.0, gt=0, description="How long a load (and a request waiting on it) may take.")
    unload_timeout_s: float = Field(300.0, gt=0, description="How long an unload waits for in-flight requests.")
    idle_unload_mode: UnloadMode = Field("stop", description="How keep_alive unloads an idle model: `stop` (no "
                                         "replica) or `sleep` (the replica stays, weights freed).")
    warm_spares: int = Field(1, ge=0, description="Idle workers kept per node with the model stack imported, so a "
                             "load starts in ~1 s instead of importing torch first (~10 s on a small CPU); each "
                             "holds ~0.4 GB. 0: none.")
    max_loaded_models: int | None = Field(None, ge=1, description="Most models loaded at once; a load past it "
                                          "first unloads idle models, the one wanted least often for what bringing "
                                          "it back costs first (default: no limit).")
    max_loaded_bytes: int | None = Field(None, ge=1, description="Most estimated bytes (weights and KV reserve) "
                                         "loaded at once, enforced the same way (default: no limit).")
    evict_mode: UnloadMode = Field("sleep", description="How a model evicted to make room is unloaded: `sleep` "
                                   "(its replica stays with the weights parked, and wakes in a fraction of a load) "
                                   "or `stop` (no replica; the next request cold-starts it).")
    max_queued_requests: int = Field(1000, ge=1, description="Most requests that may wait for one model's load; "
                                     "past it a request is a 503 with Retry-After (each waits at most "
                                     "load_timeout_s).")
    room_fairness_s: float = Field(10.0, ge=0, description="Loads waiting for room go most-requested first; one "
                                   "that has waited this long goes before any that has not (oldest first).")
    max_asleep_models: int | None = Field(4, ge=0, description="Most models asleep at once; past it the least "
                                          "recently used sleeping one is stopped (a sleeping replica still holds "
                                          "its process, ~0.5 GB on CPU). None: no limit.")
    sources: SourcePolicy = Field(default_factory=SourcePolicy, description="Where models added at runtime may "
                                  "load from (default: builtin models only).")
    limits: RequestLimits = Field(default_factory=RequestLimits, description="Body size, tokens, time per request.")
    auth: ApiKeys = Field(default_factory=ApiKeys, description="API keys (default: none needed); never saved.")

    @model_validator(mode="after")
    def _consistent(self) -> RegistryConfig:
        state = RegistryState()
        for entry in self.models:
            state.check_new(entry.spec.model_id, entry.aliases)
            state.add(entry.spec, entry.aliases)
        if self.default_model is not None:
            state.set_default(self.default_model)
        return self
