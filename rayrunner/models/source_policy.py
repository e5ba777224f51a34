"""Where models added at runtime may load from (`sources` in the router's args).

Models declared in the config are the operator's choice and load from anywhere. A model added at runtime
(`POST /v1/models/add`, a handle's `add_model`, `Runner.add_model`) may name a builtin model, a local path under one
of `local_roots`, or a hub id of one of `hub_orgs` (`"*"`: any); anything else is a 403 `permission_denied` naming
the field, before anything is read or downloaded. Both lists are empty by default, so a service exposed over HTTP
only adds builtin models until its config says more; a `Runner` that starts its own service trusts its own process
and allows every source. rayrunner never runs a model repository's own code (`trust_remote_code` is never set), so
a hub id can bring weights but not code.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rayrunner.errors import PermissionDeniedError
from rayrunner.models.sources import BUILTIN
from rayrunner.models.which import AnyWhich

ANY = "*"
# Fields of a `which` that name a place to read weights, a tokenizer, an adapter or a cache from.
_LOCATION_FIELDS = ("model_id", "quantized_model_id", "tok_model_id", "tokenizer_json", "adapter", "hf_cache_path")


class SourcePolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    local_roots: list[str] = Field(default_factory=list, description="Folders (and everything under them) that "
                                   "models added at runtime may load from; `/` allows every local path.")
    hub_orgs: list[str] = Field(default_factory=list, description="Hugging Face organisations (or users) whose "
                                "repositories models added at runtime may load from; `*` allows every one.")

    @classmethod
    def allow_all(cls) -> SourcePolicy:
        return cls(local_roots=["/"], hub_orgs=[ANY])

    def check(self, which: AnyWhich) -> None:
        """Raise PermissionDeniedError unless every location `which` names is allowed."""
        for field in _LOCATION_FIELDS:
            location = getattr(which, field, None)
            if location is not None:
                self._check_location(str(location), f"which.{field}", local_only=field == "hf_cache_path")

    def _check_location(self, location: str, param: str, local_only: bool) -> None:
        if location in BUILTIN and not local_only:
            return
        if local_only or _is_local(location):
            if not any(_under(location, root) for root in self.local_roots):
                raise PermissionDeniedError(
                    f"`{location}` is outside the local folders this service loads from "
                    f"({_listed(self.local_roots)}; the router's `sources.local_roots`)", param=param)
            return
        org = location.split("/", 1)[0] if "/" in location else ""  # `gpt2`-style ids have no organisation
        if ANY not in self.hub_orgs and org not in self.hub_orgs:
            raise PermissionDeniedError(
                f"hub repository `{location}` is not from an organisation this service loads from "
                f"({_listed(self.hub_orgs)}; the router's `sources.hub_orgs`)", param=param)


def _is_local(location: str) -> bool:
    """A path rather than a hub id: written as one, or existing here (as `rayrunner.models.sources.resolve` decides)."""
    return location.startswith(("/", ".", "~")) or os.path.exists(os.path.expanduser(location))


def _under(location: str, root: str) -> bool:
    """Whether the real path of `location` (links and `..` resolved) lies within the real path of `root`."""
    path = Path(os.path.realpath(Path(location).expanduser()))
    base = Path(os.path.realpath(Path(root).expanduser()))
    return path == base or base in path.parents


def _listed(values: list[str]) -> str:
    return "allowed: " + ", ".join(f"`{v}`" for v in values) if values else "none allowed"
