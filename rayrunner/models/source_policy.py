"""Where models added at runtime may load from, and what they may ask the engine to run (`sources` in the router's
args).

Models declared in the config are the operator's choice: they load from anywhere and set any engine setting. A model
added at runtime (`POST /v1/models/add`, a handle's `add_model`, `Runner.add_model`) may name a builtin model, a local
path under one of `local_roots`, or a hub id of one of `hub_orgs` (`"*"`: any), in every field that names a location
(`which`'s weights, tokenizer, adapter, cache, and the GGUF file inside its folder). A local path is written as one:
whatever is not spelt as a hub id (`rayrunner.models.sources.is_hub_id`) is a path, so the registry's node and the
replica's node decide alike, and a path added at runtime may not contain `..`. Unless `engine_overrides` is on, such
a model also keeps the service's vLLM interpreter (no `engine.vllm.python`) and sets only vLLM's tuning arguments
(`TUNING_ENGINE_ARGS`), so it cannot turn on `trust_remote_code` or point vLLM at other weights, tokenizers or
downloads. Anything else is a 403 `permission_denied` naming the field, before anything is registered, read or
downloaded. The spec then carries the policy (`engine.sources`), and each replica checks its locations again where
it reads them (`rayrunner.models.sources.resolve`).

Both lists are empty and `engine_overrides` off by default, so a service exposed over HTTP only adds builtin models
until its config says more; a `Runner` that starts its own service trusts its own process and allows everything.
rayrunner's own engine never runs a repository's code (`trust_remote_code` is never set); the vllm backend runs it
only where the operator's config sets `trust_remote_code` in a declared model's `engine.vllm.engine_args`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rayrunner.errors import PermissionDeniedError
from rayrunner.models.sources import BUILTIN, is_hub_id
from rayrunner.models.which import GGUF, AnyWhich

ANY = "*"
# Fields of a `which` that name a place to read weights, a tokenizer, an adapter or a cache from.
_LOCATION_FIELDS = ("model_id", "quantized_model_id", "tok_model_id", "tokenizer_json", "adapter", "hf_cache_path")

# vLLM `AsyncEngineArgs` a model added at runtime may set: batching, scheduling, KV-cache layout and memory, eager
# execution, seeding and logging. Each takes a number, a flag or a fixed choice, and changes only how fast and in how
# much memory the model the registry checked runs. Everything else stays out, because it names code
# (`trust_remote_code`, `worker_cls`, `logits_processors`, `hf_overrides` picking another architecture,
# `compilation_config`'s passes), a model or file to read (`model`, `tokenizer`, `speculative_config`'s draft model,
# `hf_config_path`, LoRA modules), a download or its place (`download_dir`, `load_format`, the `revision`s), a network
# peer (`kv_transfer_config`), or what rayrunner sets from its own fields (`dtype`, `quantization`,
# `tensor_parallel_size`, `enable_prefix_caching`). An allow-list, not a deny-list: an argument a later vLLM adds is
# refused until someone reads it and lists it here.
TUNING_ENGINE_ARGS = frozenset({
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_chunked_prefill", "max_num_partial_prefills",
    "max_long_partial_prefills", "long_prefill_token_threshold", "scheduling_policy", "block_size", "swap_space",
    "gpu_memory_utilization", "kv_cache_dtype", "enforce_eager", "disable_sliding_window", "disable_cascade_attn",
    "seed", "max_logprobs", "disable_log_stats",
})


class SourcePolicy(BaseModel):
    model_config = ConfigDict(extra="forbid")
    local_roots: list[str] = Field(default_factory=list, description="Folders (and everything under them) that "
                                   "models added at runtime may load from; `/` allows every local path.")
    hub_orgs: list[str] = Field(default_factory=list, description="Hugging Face organisations (or users) whose "
                                "repositories models added at runtime may load from; `*` allows every one.")
    engine_overrides: bool = Field(False, description="Models added at runtime may also set `engine.vllm.python`, "
                                   "any `engine.vllm.engine_args` (`trust_remote_code`, `tokenizer`, ...), not only "
                                   "the tuning ones, and `engine.image_url_allowlist`: for callers trusted as the "
                                   "operator is.")

    @classmethod
    def allow_all(cls) -> SourcePolicy:
        return cls(local_roots=["/"], hub_orgs=[ANY], engine_overrides=True)

    def check_engine(self, vllm_python: str | None, vllm_engine_args: dict[str, Any], image_allowlist: list[str]
                     ) -> None:
        """Raise PermissionDeniedError unless `engine_overrides` is on or a runtime-added model's engine settings
        keep the service's vLLM interpreter, tuning arguments only, and no remote images."""
        if not self.engine_overrides:
            _check_tuning_only(vllm_python, vllm_engine_args)
            _check_no_image_fetches(image_allowlist)

    def check(self, which: AnyWhich) -> None:
        """Raise PermissionDeniedError unless every location `which` names is allowed."""
        for field in _LOCATION_FIELDS:
            location = getattr(which, field, None)
            if location is not None:
                self._check_location(str(location), f"which.{field}", local_only=field == "hf_cache_path")
        if isinstance(which, GGUF):
            self._check_gguf_file(which.quantized_model_id, which.quantized_filename)

    def check_read(self, location: str, gguf_file: str | None, hf_cache_path: str | None) -> None:
        """`check` for what one `resolve` reads: the location, the GGUF file inside it, the hub cache."""
        self._check_location(location, "which", local_only=False)
        self._check_gguf_file(location, gguf_file)
        if hf_cache_path is not None:
            self._check_location(hf_cache_path, "which.hf_cache_path", local_only=True)

    def _check_location(self, location: str, param: str, local_only: bool) -> None:
        if location in BUILTIN and not local_only:
            return
        if local_only or not is_hub_id(location):
            self._check_local(location, param)
            return
        org = location.split("/", 1)[0] if "/" in location else ""  # `gpt2`-style ids have no organisation
        if ANY not in self.hub_orgs and org not in self.hub_orgs:
            raise PermissionDeniedError(
                f"hub repository `{location}` is not from an organisation this service loads from "
                f"({_listed(self.hub_orgs)}; the router's `sources.hub_orgs`)", param=param)

    def _check_gguf_file(self, folder: str, gguf_file: str | None) -> None:
        """The GGUF file in a local folder: a link there may point anywhere."""
        if gguf_file is not None and folder not in BUILTIN and not is_hub_id(folder):
            self._check_local(os.path.join(folder, gguf_file), "which.quantized_filename")

    def _check_local(self, location: str, param: str) -> None:
        """Inside a root both as written and with its links resolved. Nothing outside the roots is looked at, so the
        answer is the same whether something exists there or not."""
        if self.every_path():
            return
        if ".." in Path(location).parts:
            raise PermissionDeniedError(f"`{location}`: a path added at runtime may not contain `..`", param=param)
        if not any(_under(location, root) for root in self.local_roots):
            raise PermissionDeniedError(
                f"`{location}` is outside the local folders this service loads from "
                f"({_listed(self.local_roots)}; the router's `sources.local_roots`)", param=param)

    def every_path(self) -> bool:
        return any(os.path.normpath(os.path.expanduser(root)) == "/" for root in self.local_roots)


def _check_no_image_fetches(allowlist: list[str]) -> None:
    """A model added at runtime fetches no remote images: its allow-list would have the server fetch any URL it
    names for any client (the service's config may set one)."""
    if allowlist:
        raise PermissionDeniedError("engine.image_url_allowlist: a model added at runtime fetches no remote images "
                                    "(the router's `sources.engine_overrides` allows it)",
                                    param="engine.image_url_allowlist")


def _check_tuning_only(python: str | None, engine_args: dict[str, Any]) -> None:
    """The vllm backend's settings of a model added at runtime: the service's interpreter, tuning arguments only."""
    if python is not None:
        raise PermissionDeniedError("engine.vllm.python: a model added at runtime runs the service's vLLM "
                                    "interpreter (the router's `sources.engine_overrides` allows others)",
                                    param="engine.vllm.python")
    for key in engine_args:
        if key not in TUNING_ENGINE_ARGS:
            raise PermissionDeniedError(
                f"engine.vllm.engine_args: `{key}` is not one of the tuning arguments a model added at runtime may "
                f"set ({', '.join(sorted(TUNING_ENGINE_ARGS))}; the router's `sources.engine_overrides` allows "
                "all)", param=f"engine.vllm.engine_args.{key}")


def _under(location: str, root: str) -> bool:
    """Whether `location` lies within `root` as written (checked first, touching nothing on disk) and with the links
    of both resolved."""
    written = Path(os.path.abspath(os.path.expanduser(location)))
    base, real_base = Path(os.path.abspath(os.path.expanduser(root))), Path(os.path.realpath(os.path.expanduser(root)))
    if not any(written == b or b in written.parents for b in (base, real_base)):
        return False
    real = Path(os.path.realpath(written))
    return real == real_base or real_base in real.parents


def _listed(values: list[str]) -> str:
    return "allowed: " + ", ".join(f"`{v}`" for v in values) if values else "none allowed"
