"""`Which` descriptors: what to load, mirroring mistral.rs's `Which.Plain(...)`, `Which.GGUF(...)`, ...

Each descriptor is a pydantic model with a `type` tag, so the same value travels through Python, YAML
(`serve_config.yaml`) and JSON (`POST /v1/models/add`) unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from rayrunner.errors import InvalidSpecError
from rayrunner.models.architectures import Architecture, EmbeddingArchitecture, MultimodalArchitecture

Dtype = Literal["auto", "bf16", "f16", "f32"]


class _Which(BaseModel):
    """Common fields. The first field may also be given positionally, as in mistral.rs."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False)
    _positional: ClassVar[str] = "model_id"
    kind: ClassVar[Literal["text", "multimodal", "embedding"]] = "text"

    dtype: Dtype = Field("auto", description="Weights dtype; `auto` = the config's (float16 as bf16 on CPU, bf16 "
                         "as float16 on a GPU without it), bf16 when the config names none.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    hf_cache_path: str | None = Field(None, description="Hugging Face cache folder to read hub ids from.")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > 1:
            raise TypeError(f"{type(self).__name__} takes at most one positional argument")
        if args:
            kwargs[self._positional] = args[0]
        super().__init__(**kwargs)

    @field_validator("arch", mode="before", check_fields=False)
    @classmethod
    def _parse_arch(cls, value: Any) -> Any:
        if value is None:
            return None
        enum_type = cls.model_fields["arch"].annotation.__args__[0]  # type: ignore[union-attr]
        return enum_type.parse(value)

    @property
    def source(self) -> str:
        """Where the weights come from: local folder, hub id, builtin name or GGUF location."""
        return str(getattr(self, self._positional))


class Plain(_Which):
    type: Literal["plain"] = Field("plain", description="A text model from its safetensors weights.")
    model_id: str = Field(description="Local folder, hub id, or builtin name (e.g. `smollm2-135m-instruct`).")
    arch: Architecture | None = Field(None, description="The text architecture (mistral.rs's name), checked "
                                      "against the model's config when given.")
    tokenizer_json: str | None = Field(None, description="A tokenizer.json or folder to use instead.")


class MultimodalPlain(_Which):
    type: Literal["multimodal_plain"] = Field(
        "multimodal_plain", description="A vision-language model: requests send image parts as `data:` URLs "
        "(remote URLs only under the model's `engine.image_url_allowlist`).")
    kind: ClassVar[Literal["text", "multimodal", "embedding"]] = "multimodal"
    model_id: str = Field(description="Local folder or hub id.")
    arch: MultimodalArchitecture | None = Field(None, description="The vision-language architecture (mistral.rs's "
                                                "name), checked against the model's config when given.")


class Embedding(_Which):
    type: Literal["embedding"] = Field("embedding", description="A sentence-embedding model (`/v1/embeddings`).")
    kind: ClassVar[Literal["text", "multimodal", "embedding"]] = "embedding"
    model_id: str = Field(description="Local folder, hub id, or builtin name (e.g. `all-minilm-l6-v2`).")
    arch: EmbeddingArchitecture | None = Field(None, description="The embedding architecture (mistral.rs's name), "
                                               "checked against the model's config when given.")


class GGUF(_Which):
    type: Literal["gguf"] = Field("gguf", description="A text model from a GGUF file.")
    _positional: ClassVar[str] = "quantized_model_id"
    quantized_model_id: str = Field(description="Folder or hub id holding the GGUF file, or the file itself.")
    quantized_filename: str | None = Field(None, description="GGUF file name inside `quantized_model_id` (a "
                                           "plain name: no folder, `..` or absolute path).")
    tok_model_id: str | None = Field(None, description="Where to take the tokenizer from (default: the GGUF).")
    arch: Architecture | None = Field(None, description="The text architecture (mistral.rs's name), checked "
                                      "against the model's config when given.")

    @field_validator("quantized_filename")
    @classmethod
    def _plain_file_name(cls, value: str | None) -> str | None:
        """Only a name inside the folder: a path here would reach past the folder the source policy checked."""
        if value is not None and (value in ("", ".", "..") or any(c in value for c in "/\\\0")):
            raise ValueError(f"`{value}` is not a plain file name (no folder, `..` or absolute path; the folder "
                             "goes in `quantized_model_id`)")
        return value


class Lora(_Which):
    """A LoRA adapter (a peft folder) served by its base model's replica: one forward pass mixes rows of several
    adapters and of the base model. `revision` is the base model's; `hf_cache_path` serves both."""

    type: Literal["lora"] = Field("lora", description="A LoRA adapter, served by the replica of a registered "
                                  "plain model of the same base, dtype and `in_situ_quant`, else by one of its own.")
    model_id: str = Field(description="The base model: local folder, hub id, or builtin name.")
    adapter: str = Field(description="The adapter: local folder or hub id holding `adapter_config.json`.")
    arch: Architecture | None = Field(None, description="The base model's architecture (mistral.rs's name), "
                                      "checked against its config when given.")


AnyWhich = Plain | MultimodalPlain | Embedding | GGUF | Lora
WhichSpec = Annotated[AnyWhich, Field(discriminator="type")]
_ADAPTER: TypeAdapter[AnyWhich] = TypeAdapter(WhichSpec)


class Which:
    """Namespace of the descriptors: `Which.Plain(...)`, `Which.GGUF(...)`, ..."""

    Plain = Plain
    MultimodalPlain = MultimodalPlain
    Embedding = Embedding
    GGUF = GGUF
    Lora = Lora

    @staticmethod
    def parse(value: Any) -> AnyWhich:
        """A descriptor from itself or its dict form; invalid input raises `InvalidSpecError`."""
        if isinstance(value, _Which):
            return value  # type: ignore[return-value]
        try:
            return _ADAPTER.validate_python(value)
        except ValidationError as exc:
            raise InvalidSpecError(f"invalid `which`: {_first_error(exc)}", param=_param(exc)) from None


def _param(exc: ValidationError) -> str:
    """`which.<field>` for the first error in a field (the loc's first part is the type's tag), else `which`."""
    loc = exc.errors()[0]["loc"]
    return ".".join(["which", *(str(p) for p in loc[1:])])


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    hint = " (expected type: plain, multimodal_plain, embedding, gguf or lora)" if "type" in where or not where else ""
    message = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}{hint}" if where else message + hint
