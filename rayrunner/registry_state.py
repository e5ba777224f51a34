"""The registry's data: model records, aliases and the default, their checks, and their file.

Pure logic with no Ray in it: the registry actor (`rayrunner.registry`) serialises changes and drives Serve; this
module decides what a change means and whether it is allowed, and persists the result atomically.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayrunner.errors import AliasConflictError, InvalidSpecError, ModelExistsError, ModelNotFoundError
from rayrunner.protocol import DEFAULT_MODEL
from rayrunner.spec import ModelSpec

Status = Literal["loaded", "unloaded", "reloading"]


class ModelEntry(BaseModel):
    """A model as declared in a config or added at runtime: its spec, aliases, and whether to load it now."""

    model_config = ConfigDict(extra="forbid")
    spec: ModelSpec
    aliases: list[str] = Field(default_factory=list)
    load: bool = True


class RegistryConfig(BaseModel):
    """The router's `args`: every model it serves, the default, and where the registry keeps its state."""

    model_config = ConfigDict(extra="forbid")
    models: list[ModelEntry] = Field(default_factory=list)
    default_model: str | None = Field(None, description="Model id or alias; default: the first model.")
    state_path: str | None = Field(None, description="Registry state file (default under the cache dir).")
    load_timeout_s: float = Field(900.0, gt=0, description="How long a load (and a request waiting on it) may take.")
    unload_timeout_s: float = Field(300.0, gt=0, description="How long an unload waits for in-flight requests.")

    @model_validator(mode="after")
    def _consistent(self) -> RegistryConfig:
        state = RegistryState()
        for entry in self.models:
            state.check_new(entry.spec.model_id, entry.aliases)
            state.add(entry.spec, entry.aliases)
        if self.default_model is not None:
            state.set_default(self.default_model)
        return self


class ModelRecord(BaseModel):
    spec: ModelSpec
    status: Status = "unloaded"
    aliases: list[str] = Field(default_factory=list)
    registered_at: float = Field(default_factory=time.time)
    loaded_at: float | None = None
    last_error: str | None = None
    load_count: int = 0
    info: dict[str, Any] = Field(default_factory=dict, description="What the replica reported when it loaded.")


class RegistryState(BaseModel):
    """Every registered model (in registration order) and the default id."""

    models: dict[str, ModelRecord] = Field(default_factory=dict)
    default_id: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict, description="The last config's timeouts and paths.")

    # ------------------------------------------------------------ lookups

    def alias_owner(self, alias: str) -> str | None:
        return next((mid for mid, rec in self.models.items() if alias in rec.aliases), None)

    def resolve(self, name: str) -> str:
        """Model id for an id, an alias, or `default`; raises ModelNotFoundError."""
        if name == DEFAULT_MODEL:
            if self.default_id is None:
                raise ModelNotFoundError(DEFAULT_MODEL)
            return self.default_id
        if name in self.models:
            return name
        owner = self.alias_owner(name)
        if owner is None:
            raise ModelNotFoundError(name)
        return owner

    def route(self, model_id: str) -> dict[str, Any]:
        """What a router needs to send a request to `model_id`."""
        record = self.models[model_id]
        return {"model_id": model_id, "app_name": record.spec.app_name, "status": record.status,
                "kind": record.spec.kind}

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

    def ids_with_status(self, status: Status) -> list[str]:
        return [mid for mid, rec in self.models.items() if rec.status == status]

    # ------------------------------------------------------------ checks

    def _check_name_free(self, name: str) -> None:
        if name == DEFAULT_MODEL:
            raise AliasConflictError("`default` is reserved and cannot name a model or alias", param="alias")
        if name in self.models:
            raise AliasConflictError(f"`{name}` is already a model id", param="alias")
        owner = self.alias_owner(name)
        if owner is not None:
            raise AliasConflictError(f"alias `{name}` already points at model `{owner}`", param="alias")

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

    def remove(self, model_id: str) -> None:
        del self.models[model_id]
        if self.default_id == model_id:
            self.default_id = None
            self.move_default_from(model_id)

    def add_alias(self, model_id: str, alias: str) -> None:
        self._check_name_free(alias)
        self.models[model_id].aliases.append(alias)

    def set_default(self, name: str) -> str:
        self.default_id = self.resolve(name)
        return self.default_id

    def move_default_from(self, model_id: str) -> None:
        """After `model_id` was unloaded or removed: the default moves to the first loaded model, if any."""
        if self.default_id not in (model_id, None):
            return
        loaded = self.ids_with_status("loaded")
        if loaded:
            self.default_id = loaded[0]
        elif self.default_id is None and self.models:
            self.default_id = next(iter(self.models))

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
