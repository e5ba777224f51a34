"""The full load spec of one model: what to load (`Which`), how to quantize it, and how to run it.

The registry stores exactly this, so an unloaded model can be rebuilt with the same settings.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rayrunner.errors import InvalidSpecError
from rayrunner.models.replicas import Replicas
from rayrunner.models.source_policy import SourcePolicy
from rayrunner.models.which import Which, WhichSpec

DEFAULT_MODEL = "default"  # the alias every request may name for the default model; never a model's id


class VllmSettings(BaseModel):
    """How the `vllm` backend runs its engine (`rayrunner.engines.vllm.engine`)."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_bytes: int = Field(
        1 << 30, ge=1 << 20, description="Bytes vLLM reserves for its KV cache (CPU and GPU alike), counted by "
        "capacity; vLLM's own default takes 90% of the device's memory, which leaves no room for another model."
    )
    compile: bool = Field(
        False, description="torch.compile and CUDA graphs (vLLM's default): faster decode, minutes more at start; "
        "off runs eager (`enforce_eager`)."
    )
    sleep_level: Literal[1, 2] = Field(
        1, description="CUDA sleep: 1 offloads the weights to host memory (wake without reading them again), 2 drops "
        "them. On CPU, sleep ends the engine and wake starts it again."
    )
    python: str | None = Field(
        None, description="The interpreter of this model's replicas, a venv holding vLLM and the same Ray (default: "
        "`$RAYRUNNER_VLLM_PYTHON`, else this interpreter when it imports vllm, else the checkout's `.venv-vllm`)."
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="More of vLLM's `AsyncEngineArgs` by name (e.g. `gpu_memory_utilization`), "
        "checked by vLLM when the model loads."
    )


class EngineSettings(Replicas):
    """How a model's replicas run: how many (`Replicas`), placement, batching and request limits."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["transformers", "vllm"] = Field(
        "transformers", description="The engine inside the replica: rayrunner's own (transformers' modelling and "
        "rayrunner's step scheduler), or vLLM's async engine (text models; settings in `vllm`; its own venv: "
        "`bash scripts/install_vllm.sh`; docs/engines.md)."
    )
    vllm: VllmSettings = Field(default_factory=VllmSettings, description="The `vllm` backend's settings.")
    sources: SourcePolicy | None = Field(
        None, description="Where this model may load from, checked again by each replica where it reads: the "
        "service's `sources`, set by the registry for a model added at runtime (whatever the caller sent). None: "
        "anywhere, as for a model the operator declared."
    )

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto`: cuda when the replica has a GPU.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved by each replica; above 1 a whole number, the "
                            "model spread over them (transformers: layers by `device_map`; vllm: tensor parallel).")
    num_cpus: float = Field(
        0.125, ge=0, description="CPUs reserved by each replica (fractional is fine). A placement slot, not a core: "
        "the busy engines share the node's cores at run time (`runtime.core_share`), and a sleeping "
        "replica keeps its reservation, so the default lets a 2-core node hold 15 model replicas, loaded or asleep; "
        "what bounds them is memory (`max_loaded_models`, `max_loaded_bytes`, `max_asleep_models`).")
    accelerator_type: str | None = Field(
        None, min_length=1, description="Ray's `accelerator_type` (e.g. `A10G`, `H100`): the replica runs only on a "
        "node with resource `accelerator_type:<type>`."
    )
    memory: int | None = Field(None, ge=1, description="Bytes of Ray's `memory` resource reserved by each replica.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources reserved by each replica, `{name: amount}`."
    )
    torch_threads: int | None = Field(
        None, ge=1, description="Most torch intra-op threads (default: the replica's share of the node's cores, "
        "divided among the engines busy right now; see `runtime.core_share`)."
    )
    max_num_seqs: int = Field(32, ge=1, description="Most sequences decoded together in one step.")
    max_queued_requests: int = Field(
        256, ge=0, description="Most requests waiting for a free sequence slot; past it requests get a 429 with "
        "Retry-After."
    )
    prefill_chunk_tokens: int = Field(
        2048, ge=16, description="Prompt tokens prefilled per step, several short prompts or a chunk of a long "
        "one (longer prompts take several steps); vLLM's default on CPU. Smaller: a long prompt stalls running "
        "streams for less (~2.5 s a step at 2,048 for SmolLM2 on one CPU core); larger: more prompts arriving "
        "together start together."
    )
    max_seq_len: int | None = Field(None, ge=1, description="Prompt + completion token limit (default: the "
                                        "model's).")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="Bytes one replica's KV caches may hold (running sequences, prompts being "
        "prefilled, reused prefixes): admission waits for room, the newest sequences are preempted (recomputed "
        "later) rather than pass it. Counted by capacity (`max_loaded_bytes`), the default too. Default: 1 GiB on "
        "CPU; on a GPU, half of what the replica's share of it (`num_gpus`) leaves beside its weights "
        "(`models.footprint.gpu_kv_budget`). "
        "The vllm backend reserves it at start (unset: `vllm.kv_cache_bytes`)."
    )
    prefix_caching: bool = Field(
        True, description="Reuse the KV of a prompt's start already computed (a chat's earlier turns, a shared "
        "system prompt) instead of prefilling it again; usage reports `prompt_tokens_details.cached_tokens` (the vllm "
        "backend: vLLM's `enable_prefix_caching`)."
    )
    prefill_aside: bool = Field(
        True, description="On a CPU, with a share of two cores or more: prompts arriving while streams decode (no "
        "more of them than streams) are prefilled in a second thread while the decode steps go on, each with one "
        "core, instead of in the step's own forward with both (streams never wait on a prefill; a model busy alone "
        "keeps both cores working; figures: docs/performance.md, \"Prefill aside\")."
    )
    cache_quantized: bool = Field(
        True, description="Keep the model, once quantized in situ, in a local file that later loads read instead of "
        "loading and quantizing again (disk: the quantized weights' size; see `quantization.model_cache`)."
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none.")
    chat_template: str | None = Field(None, description="Jinja chat template overriding the model's.")
    max_adapters: int = Field(8, ge=1, description="Most LoRA adapters held loaded at once (least recently used "
                              "evicted; an evicted one is reloaded from its source when asked for again).")
    max_ongoing_requests: int | None = Field(
        None, ge=1, description="Requests Serve sends one replica at once (default: room for every running and "
        "queued sequence, so the replica itself answers 429 when full)."
    )
    graceful_shutdown_timeout_s: float = Field(60.0, ge=0, description="How long unload waits for requests.")
    image_url_allowlist: list[str] = Field(
        default_factory=list, description="URL prefixes from which remote images may be fetched (default none)."
    )
    max_image_bytes: int = Field(10 * 1024 * 1024, ge=1, description="Largest image accepted.")
    image_fetch_timeout_s: float = Field(10.0, gt=0, description="Time limit for fetching a remote image.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Specs saved before the step scheduler: `max_batch_size` is now `max_num_seqs`; `batch_wait_ms` is gone
        (sequences join at the next step, nothing waits for companions)."""
        if isinstance(data, dict) and ("max_batch_size" in data or "batch_wait_ms" in data):
            data = dict(data)
            data.pop("batch_wait_ms", None)
            if "max_batch_size" in data:
                data.setdefault("max_num_seqs", data.pop("max_batch_size"))
        return data

    @field_validator("num_gpus")
    @classmethod
    def _whole_above_one(cls, value: float) -> float:
        if value > 1 and not value.is_integer():
            raise ValueError(f"{value} GPUs: a replica takes a fraction of one GPU or a whole number of them")
        return value

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, value: dict[str, float]) -> dict[str, float]:
        fields = {"CPU": "num_cpus", "GPU": "num_gpus", "memory": "memory", "object_store_memory": None}
        for name, amount in value.items():
            if name in fields or name.startswith("accelerator_type:"):
                instead = fields.get(name, "accelerator_type")
                raise ValueError(f"`{name}` is not a custom resource" + (f"; use `{instead}`" if instead else ""))
            if amount < 0:
                raise ValueError(f"resource `{name}` cannot be negative")
        return value

    def ray_actor_options(self) -> dict[str, Any]:
        """The replica's Ray actor options: what it reserves and which nodes may hold it."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.accelerator_type is not None:
            options["accelerator_type"] = self.accelerator_type
        if self.memory is not None:
            options["memory"] = self.memory
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def replica_max_ongoing_requests(self) -> int:
        """Serve's per-replica limit: every running and queued sequence, plus room for admin calls."""
        return self.max_ongoing_requests or self.max_num_seqs + self.max_queued_requests + 8


class ModelSpec(BaseModel):
    """Everything needed to (re)load one model."""

    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(min_length=1, description="The id requests use; may contain `/`; `default` is reserved.")
    which: WhichSpec = Field(description="What to load, tagged by `type`: `plain`, `gguf`, `multimodal_plain`, "
                             "`embedding` or `lora`.")
    in_situ_quant: str | None = Field(None, description="Quantize while loading, by mistral.rs's ISQ names (any "
                                      "case): `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q8_0`, `Q8_1`, `Q2K` ... `Q8K`, "
                                      "`HQQ4`, `HQQ8`, `FP8`, or a bit width (`2`-`6`, `8`); the vllm backend takes "
                                      "`FP8` only. The model card says what was applied.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="How its replicas run.")

    @field_validator("model_id")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        if value == DEFAULT_MODEL:
            raise ValueError("`default` is reserved")
        return value

    @field_validator("in_situ_quant")
    @classmethod
    def _valid_isq(cls, value: str | None) -> str | None:
        if value is None:
            return None
        from rayrunner.quantization import parse_isq

        return parse_isq(value).name

    @model_validator(mode="after")
    def _backend_serves_it(self) -> ModelSpec:
        """The vllm backend serves text models (plain, GGUF, LoRA) and quantizes in situ only to FP8."""
        if self.engine.backend != "vllm":
            return self
        if self.kind != "text":
            raise ValueError(f"engine.backend `vllm` serves text models, not {self.kind} ones (use the "
                             "`transformers` backend)")
        if self.in_situ_quant not in (None, "FP8"):
            raise ValueError(f"in_situ_quant `{self.in_situ_quant}`: the vllm backend quantizes in situ only to "
                             "`FP8` (vLLM's `quantization: fp8`, on CUDA)")
        return self

    @property
    def kind(self) -> str:
        return self.which.kind

    def without_replicas(self) -> ModelSpec:
        """The spec with its replica settings (how many replicas run, how requests pick one) at their defaults:
        what stays the same when a model is only rescaled."""
        engine = self.engine.model_dump(exclude=set(Replicas.model_fields))
        return self.model_copy(update={"engine": EngineSettings.model_validate(engine)})

    def replica_args(self) -> dict[str, Any]:
        """What each replica is constructed with: the spec less its replica settings, so a change of those alone is
        one Serve scales in place (same deployment version), restarting no replica."""
        return self.without_replicas().model_dump(mode="json")

    def rescaled(self, changes: dict[str, Any]) -> ModelSpec:
        """This spec with new replica settings (`num_replicas` or `autoscaling_config`, `routing`): one way of
        counting replicas replaces the other; anything else, or an invalid value, is an `InvalidSpecError`."""
        unknown = set(changes) - set(Replicas.model_fields)
        if unknown:
            raise InvalidSpecError(f"only replica settings change here, not {sorted(unknown)}", param=min(unknown))
        current = self.engine.model_dump(mode="json")
        if changes.keys() & {"num_replicas", "autoscaling_config"}:
            current.pop("num_replicas")
            current.pop("autoscaling_config")
        return build_spec(self.model_id, self.which.model_dump(mode="json"), self.in_situ_quant,
                          {**current, **changes})

    @property
    def app_name(self) -> str:
        """Serve application name: readable, unique per id, and safe in URLs."""
        return model_app_name(self.model_id)

    def confined(self, policy: SourcePolicy) -> ModelSpec:
        """This spec of a model added at runtime, checked against `policy` (403 for what it does not allow), carrying
        it in `engine.sources` (whatever the caller put there) for the replicas to check again, or carrying none
        when it allows every path."""
        policy.check(self.which)
        vllm = self.engine.vllm
        policy.check_engine(vllm.python, vllm.engine_args, self.engine.image_url_allowlist)
        return self.carrying(None if policy.every_path() else policy)

    def carrying(self, policy: SourcePolicy | None) -> ModelSpec:
        """This spec with `policy` as its `engine.sources`."""
        return self.model_copy(update={"engine": self.engine.model_copy(update={"sources": policy})})


def model_app_name(model_id: str) -> str:
    """The id itself when it is URL-safe (readable in `serve status`), else a slug plus a short hash."""
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", model_id):
        return model_id
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", model_id).strip("-")[:40] or "model"
    digest = hashlib.sha1(model_id.encode()).hexdigest()[:6]
    return f"{slug}-{digest}"


def build_spec(
    model_id: str, which: Any, in_situ_quant: str | None = None, engine: dict[str, Any] | None = None
) -> ModelSpec:
    """A validated spec from loose parts; every problem is an `InvalidSpecError` (HTTP 400)."""
    parsed = Which.parse(which)
    try:
        return ModelSpec(
            model_id=model_id, which=parsed, in_situ_quant=in_situ_quant,
            engine=EngineSettings.model_validate(engine or {}),
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        if not err["loc"]:  # the spec as a whole (`_backend_serves_it`): its message starts with the field's name
            message = err["msg"].removeprefix("Value error, ")
            raise InvalidSpecError(message, param=re.split(r"[ .]", message, maxsplit=1)[0]) from None
        raise InvalidSpecError(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}", param=str(err["loc"][0])
        ) from None
