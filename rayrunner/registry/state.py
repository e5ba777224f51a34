"""The registry's data: model records, aliases and the default, their checks, and their file.

Pure logic with no Ray in it: the registry actor (`rayrunner.registry.actor`) serialises changes and drives Serve; this
module decides what a change means and whether it is allowed, and persists the result atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from rayrunner.errors import (
    AliasConflictError,
    InvalidSpecError,
    ModelExistsError,
    ModelNotFoundError,
    NoDefaultModelError,
    SpecMismatchError,
)
from rayrunner.models.keep_alive import KeepAlive, checked_keep_alive
from rayrunner.models.spec import DEFAULT_MODEL, ModelSpec
from rayrunner.models.which import Lora, Plain
from rayrunner.registry.lifecycle import STATUS, Phase, Status, UnloadMode, check_move, phase_of, unload_mode


def spec_differences(old: ModelSpec, new: ModelSpec) -> list[str]:
    """`field: old -> new` for each field (dotted when nested) that differs between two specs."""

    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(value, dict):
            return {prefix: value}
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}

    before, after = flat(old.model_dump(mode="json")), flat(new.model_dump(mode="json"))
    return [f"{key.rstrip('.')}: {before.get(key)!r} -> {after.get(key)!r}"
            for key in sorted(before.keys() | after.keys()) if before.get(key) != after.get(key)]


@dataclass
class ConfigChanges:
    """What `RegistryState.apply_config` did: ids it registered, ids whose spec it replaced (and of those, which
    changed only their replicas), and a log line each."""

    added: list[str] = field(default_factory=list)
    respecified: list[str] = field(default_factory=list)
    rescaled: list[str] = field(default_factory=list)  # of those, respecified in replica count or routing only
    log: list[str] = field(default_factory=list)


class ModelEntry(BaseModel):
    """A model as declared in a config or added at runtime: its spec, aliases, and whether to load it now."""

    model_config = ConfigDict(extra="forbid")
    spec: ModelSpec = Field(description="What to load and how to run it.")
    aliases: list[str] = Field(default_factory=list, description="Other names requests may use for the model.")
    load: bool = Field(True, description="Load when the config is applied; false: registered unloaded, loaded on "
                       "first use or reload.")
    pinned: bool | None = Field(None, description="Never evicted to make room for another model (unset: as "
                                "registered, False for a new model).")
    keep_alive: Annotated[KeepAlive, AfterValidator(checked_keep_alive)] = Field(
        None, description='Unload after this long idle: "5m", "30s", seconds, -1 forever (unset: as registered, '
        "forever for a new model).")


class ModelRecord(BaseModel):
    spec: ModelSpec
    phase: Phase = Field(Phase.STOPPED, description="Where the model is in its lifecycle "
                         "(`rayrunner.registry.lifecycle`); `status` and `unload_mode` follow from it.")
    status: Status = "unloaded"
    aliases: list[str] = Field(default_factory=list)
    registered_at: float = Field(default_factory=time.time)
    loaded_at: float | None = None
    last_error: str | None = None
    load_count: int = 0
    info: dict[str, Any] = Field(default_factory=dict, description="What the replica reported when it loaded.")
    pinned: bool = False
    config_pinned: bool | None = Field(None, description="The `pinned` the last applied config declared; a config "
                                       "changes `pinned` only when its own value differs from this (so a pin or "
                                       "unpin made at runtime outlives restarts with the same config).")
    keep_alive: KeepAlive = None
    request_keep_alive: KeepAlive = Field(None, description="The last request's own keep_alive, which wins.")
    last_used_at: float | None = None
    load_seconds: float | None = Field(None, description="How long the last load took (what evicting it costs).")
    recent_uses: float = Field(0.0, description="Requests lately, each weighing half as much every "
                               "`capacity.USE_HALF_LIFE_S` (how often the model is wanted, for eviction).")
    recent_uses_at: float | None = Field(None, description="When `recent_uses` was last counted.")
    unloaded_reason: str | None = Field(None, description="`user`, `idle`, or `evicted: <limit>`.")
    unload_mode: UnloadMode | None = Field(None, description="`stop`: no replica; `sleep`: the replica process "
                                           "stays with its weights freed, and wakes in a fraction of a load.")
    estimated_bytes: int | None = Field(None, description="Weights and KV reserve (under max_loaded_bytes only).")
    deployed_version: str | None = Field(None, description="The Serve version of the load now running; a new "
                                         "replica count is deployed as it, so Serve rescales in place.")

    @model_validator(mode="before")
    @classmethod
    def _phase_from_status(cls, data: Any) -> Any:
        """A state file saved before phases existed: the phase its status and unload mode describe."""
        if isinstance(data, dict) and "phase" not in data:
            return {**data, "phase": phase_of(data.get("status", "unloaded"), data.get("unload_mode"))}
        return data

    def move(self, phase: Phase) -> None:
        """Change phase by a move of the lifecycle table (raises `LifecycleError` for any other)."""
        check_move(self.spec.model_id, self.phase, phase)
        self.observe(phase)

    def observe(self, phase: Phase) -> None:
        """Set the phase that Serve shows the model in, whatever it was (only reconciliation does this)."""
        self.phase, self.status = phase, STATUS[phase]
        if self.status != "reloading":  # a load keeps how the model was unloaded: a sleeping replica is woken
            self.unload_mode = unload_mode(phase)

    def mark_loaded(self, load_seconds: float) -> None:
        """A load finished: `loaded`, timed and counted, with the last failure and unload reason cleared."""
        self.move(Phase.LOADED)
        self.loaded_at = time.time()
        self.load_seconds = load_seconds
        self.last_error = None
        self.unloaded_reason = None
        self.load_count += 1

    def mark_unloaded(self, reason: str, mode: UnloadMode) -> None:
        """Unloaded by `mode` for `reason`. The last request's keep_alive applied to the load that ends here."""
        self.move(Phase.ASLEEP if mode == "sleep" else Phase.STOPPED)
        self.unloaded_reason = reason
        self.request_keep_alive = None

    def mark_failed(self, error: str) -> None:
        """A load failed: `error` in `last_error`, and the info of no replica."""
        self.move(Phase.FAILED)
        self.last_error = error
        self.info = {}

    def configure(self, entry: ModelEntry) -> None:
        """Take the entry's pinned and keep_alive where it sets them."""
        if entry.pinned is not None:
            self.pinned = entry.pinned
        if entry.keep_alive is not None:
            self.keep_alive = entry.keep_alive

    def configure_declared(self, entry: ModelEntry) -> None:
        """`configure` for a config's entry, whose `pinned` applies only when it changed since the last config:
        every router start applies its config again, which must not undo a runtime pin or unpin."""
        if entry.pinned == self.config_pinned:
            entry = entry.model_copy(update={"pinned": None})
        else:
            self.config_pinned = entry.pinned
        self.configure(entry)

    def effective_keep_alive(self) -> KeepAlive:
        return self.request_keep_alive if self.request_keep_alive is not None else self.keep_alive


class RegistryState(BaseModel):
    """Every registered model (in registration order) and the default id."""

    models: dict[str, ModelRecord] = Field(default_factory=dict)
    default_id: str | None = None
    config_default: str | None = Field(
        None, description="The default the last applied config declared; a config changes the default only when "
        "its own value differs from this (so a default set at runtime outlives restarts with the same config).")
    settings: dict[str, Any] = Field(default_factory=dict, description="The last config's timeouts and paths.")

    # ------------------------------------------------------------ lookups

    def alias_owner(self, alias: str) -> str | None:
        return next((mid for mid, rec in self.models.items() if alias in rec.aliases), None)

    def resolve(self, name: str) -> str:
        """Model id for an id, an alias, or `default`; raises ModelNotFoundError."""
        if name == DEFAULT_MODEL:
            if self.default_id is None:
                raise NoDefaultModelError()
            return self.default_id
        if name in self.models:
            return name
        owner = self.alias_owner(name)
        if owner is None:
            raise ModelNotFoundError(name)
        return owner

    def route(self, model_id: str) -> dict[str, Any]:
        """What a router needs to send a request to `model_id`. A LoRA model with a host goes to the host's replica
        (`serving_id`), with the adapter to apply and where to load it from."""
        host = self.host_of(model_id)
        serving = self.models[host or model_id]
        route = {"model_id": model_id, "app_name": serving.spec.app_name, "status": serving.status,
                 "kind": self.models[model_id].spec.kind}
        which = self.models[model_id].spec.which
        if host is not None and isinstance(which, Lora):
            route.update(serving_id=host, adapter=model_id, adapter_source=which.adapter)
        return route

    def host_of(self, model_id: str) -> str | None:
        """The model whose replica serves a LoRA model: a registered plain model of the same base, dtype and
        quantization. None for other models, and for a LoRA model without one (it runs a replica of its own), as
        on the vllm backend (vLLM serves adapters only when started for them)."""
        spec = self.models[model_id].spec
        if not isinstance(spec.which, Lora) or spec.engine.backend != "transformers":
            return None
        for other_id, other in self.models.items():
            which = other.spec.which
            if (isinstance(which, Plain) and which.model_id == spec.which.model_id and which.dtype == spec.which.dtype
                    and other.spec.in_situ_quant == spec.in_situ_quant and other.spec.engine.backend == "transformers"):
                return other_id
        return None

    def pinned(self, model_id: str) -> bool:
        """Whether capacity must keep `model_id` loaded: it is pinned, or it hosts a pinned LoRA model (which would
        unload with it)."""
        return self.models[model_id].pinned or any(
            record.pinned and self.host_of(other_id) == model_id for other_id, record in self.models.items())

    def serving(self, model_id: str) -> ModelRecord:
        """The record of the model whose replica serves `model_id` (itself, or a LoRA model's host)."""
        return self.models[self.host_of(model_id) or model_id]

    def routes(self) -> dict[str, dict[str, Any]]:
        """The route of every name that resolves: each model id, each alias, and `default` when one is set."""
        table = {model_id: self.route(model_id) for model_id in self.models}
        for model_id, record in self.models.items():
            table.update(dict.fromkeys(record.aliases, table[model_id]))
        if self.default_id is not None:
            table[DEFAULT_MODEL] = table[self.default_id]
        return table

    def record(self, name: str) -> ModelRecord:
        return self.models[self.resolve(name)]

    # ------------------------------------------------------------ checks

    def _check_name_free(self, name: str) -> None:
        if name == DEFAULT_MODEL:
            raise AliasConflictError("`default` is reserved and cannot name a model or alias", param="alias")
        if name in self.models:
            raise AliasConflictError(f"`{name}` is already a model id", param="alias")
        owner = self.alias_owner(name)
        if owner is not None:
            raise AliasConflictError(f"alias `{name}` already points at model `{owner}`", param="alias")

    def _check_alias_for(self, model_id: str, alias: str) -> None:
        """`alias` may name `model_id`: it is free, or already names that model."""
        if alias not in self.models[model_id].aliases:
            self._check_name_free(alias)

    def check_new(self, model_id: str, aliases: list[str]) -> None:
        if model_id in self.models:
            raise ModelExistsError(model_id)
        if self.alias_owner(model_id) is not None:
            raise AliasConflictError(f"model id `{model_id}` is already an alias", param="model_id")
        if len(set(aliases)) != len(aliases) or model_id in aliases:
            raise InvalidSpecError("aliases must be unique and differ from the model id", param="aliases")
        for alias in aliases:
            self._check_name_free(alias)

    # ------------------------------------------------------------ changes

    def add(self, spec: ModelSpec, aliases: list[str]) -> ModelRecord:
        record = ModelRecord(spec=spec, aliases=list(aliases))
        self.models[spec.model_id] = record
        if self.default_id is None:
            self.default_id = spec.model_id
        return record

    def attach(self, spec: ModelSpec, aliases: list[str]) -> ModelRecord:
        """An add of a registered model with the same spec: adds the aliases it lacks, changes nothing else. Replica
        settings do not count: the registered ones stay (an operator's `scale` outlives a script's `Runner(...)`)."""
        record = self.models[spec.model_id]
        differences = spec_differences(record.spec.without_replicas(), spec.without_replicas())
        if differences:
            raise SpecMismatchError(spec.model_id, "; ".join(differences))
        for alias in aliases:
            self._check_alias_for(spec.model_id, alias)
        record.aliases += [alias for alias in dict.fromkeys(aliases) if alias not in record.aliases]
        return record

    def remove(self, model_id: str) -> None:
        """Forget a model. If it was the default, the default moves to a model of the same kind (a loaded one
        first), or there is none: never to another kind, whose requests `default` callers do not send."""
        kind = self.models.pop(model_id).spec.kind
        if self.default_id != model_id:
            return
        same_kind = [mid for mid, rec in self.models.items() if rec.spec.kind == kind]
        loaded = [mid for mid in same_kind if self.models[mid].status == "loaded"]
        self.default_id = next(iter(loaded + same_kind), None)

    def add_alias(self, model_id: str, alias: str) -> bool:
        """Returns False (and changes nothing) when the alias already names this model."""
        self._check_alias_for(model_id, alias)
        if alias in self.models[model_id].aliases:
            return False
        self.models[model_id].aliases.append(alias)
        return True

    def set_default(self, name: str) -> str:
        self.default_id = self.resolve(name)
        return self.default_id

    def apply_config(self, models: list[ModelEntry], default_model: str | None) -> ConfigChanges:
        """Make a config's `models` and `default_model` the source of truth for what they declare: the models' specs
        (new ones are registered, changed ones replaced), their aliases (added where free), and the default and each
        model's `pinned` when the config's own value changed since the last config. Models and aliases added at
        runtime, and a runtime default or pin, are kept."""
        changes = ConfigChanges()
        for entry in models:
            model_id = entry.spec.model_id
            if model_id not in self.models:
                self.check_new(model_id, entry.aliases)
                self.add(entry.spec, entry.aliases).configure_declared(entry)
                changes.added.append(model_id)
                changes.log.append(f"model `{model_id}` registered from the config")
                continue
            self.models[model_id].configure_declared(entry)
            differences = spec_differences(self.models[model_id].spec, entry.spec)
            if differences:
                old = self.models[model_id].spec
                self.models[model_id].spec = entry.spec
                changes.respecified.append(model_id)
                if old.without_replicas() == entry.spec.without_replicas():
                    changes.rescaled.append(model_id)
                changes.log.append(f"model `{model_id}`: spec changed by the config ({'; '.join(differences)})")
            for alias in entry.aliases:
                try:
                    if self.add_alias(model_id, alias):
                        changes.log.append(f"model `{model_id}`: alias `{alias}` added by the config")
                except AliasConflictError as exc:
                    changes.log.append(f"model `{model_id}`: config alias `{alias}` not added: {exc.message}")
        declared = default_model or next((e.spec.model_id for e in models), None)
        if declared != self.config_default:
            if declared is not None:
                self.set_default(declared)
                changes.log.append(f"default set to `{self.default_id}` by the config (`{declared}`)")
            self.config_default = declared
        return changes

    # ------------------------------------------------------------ persistence

    def save(self, path: Path) -> None:
        """Atomically: a crash leaves either the old file or the new one, never half of one."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            handle.write(self.model_dump_json(indent=2))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> RegistryState:
        if not path.exists():
            return cls()
        return cls.model_validate(json.loads(path.read_text()))
