"""mistral.rs architecture names, mapped to transformers `model_type`s.

`arch` is optional everywhere: when it is given it is checked against the model's config, so a wrong guess fails
early with a clear message instead of loading the wrong head. Vision-language families whose positions rayrunner
cannot give (`MROPE_MODEL_TYPES`) are refused, by `arch` when the spec is parsed and by the config's `model_type`
when a multimodal model loads.
"""

from __future__ import annotations

from enum import Enum

from rayrunner.errors import InvalidSpecError

# Vision-language models whose positions are M-RoPE's: 3-D, computed by the model's own rope index from where each
# image sits in the prompt (transformers' `get_rope_index`), and offset per sequence while decoding. The step
# scheduler gives every row plain 1-D positions, which would read the images and the text after them at the wrong
# positions: a wrong answer rather than an error. They stay refused until the scheduler carries those positions.
# A model of another type that has a rope index of its own is refused once loaded (`loading`).
MROPE_MODEL_TYPES = frozenset({
    "qwen2_vl", "qwen2_5_vl", "qwen2_5_omni", "qwen2_5_omni_thinker", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe",
    "qwen3_omni_moe_thinker", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe", "glm46v", "glm_ocr", "ernie4_5_vl_moe",
    "paddleocr_vl", "hunyuan_vl",
})


class _ArchEnum(str, Enum):
    """Each member's value is the transformers `model_type` it loads as (None: transformers has no such model)."""

    def __new__(cls, name: str, model_type: str | None) -> _ArchEnum:
        obj = str.__new__(cls, name)
        obj._value_ = name
        obj.model_type = model_type
        return obj

    model_type: str | None

    @classmethod
    def parse(cls, value: str | _ArchEnum) -> _ArchEnum:
        """The member named by `value` (its name in any case, with or without `_`/`-`, or its `model_type`); an
        unknown name, or an architecture rayrunner refuses to serve, is an InvalidSpecError."""
        member = value if isinstance(value, cls) else cls._lookup(value)
        if member.model_type in MROPE_MODEL_TYPES:
            raise mrope_refusal(f"architecture `{member.value}`", "arch")
        return member

    @classmethod
    def _lookup(cls, value: str | _ArchEnum) -> _ArchEnum:
        wanted = str(value).replace("-", "").replace("_", "").lower()
        for member in cls:
            if member.value.replace("_", "").lower() == wanted or (member.model_type or "") == str(value):
                return member
        names = ", ".join(m.value for m in cls)
        raise InvalidSpecError(f"unknown {cls.__name__} `{value}`; valid: {names}", param="arch")


class Architecture(_ArchEnum):
    Mistral = ("Mistral", "mistral")
    Gemma = ("Gemma", "gemma")
    Mixtral = ("Mixtral", "mixtral")
    Llama = ("Llama", "llama")
    Phi2 = ("Phi2", "phi")
    Phi3 = ("Phi3", "phi3")
    Qwen2 = ("Qwen2", "qwen2")
    Gemma2 = ("Gemma2", "gemma2")
    Starcoder2 = ("Starcoder2", "starcoder2")
    Phi3_5MoE = ("Phi3_5MoE", "phimoe")
    DeepseekV2 = ("DeepseekV2", "deepseek_v2")
    DeepseekV3 = ("DeepseekV3", "deepseek_v3")
    Qwen3 = ("Qwen3", "qwen3")
    GLM4 = ("GLM4", "glm4")
    GLM4Moe = ("GLM4Moe", "glm4_moe")
    Qwen3Moe = ("Qwen3Moe", "qwen3_moe")
    SmolLm3 = ("SmolLm3", "smollm3")
    GraniteMoeHybrid = ("GraniteMoeHybrid", "granitemoehybrid")
    GptOss = ("GptOss", "gpt_oss")
    Qwen3Next = ("Qwen3Next", "qwen3_next")


class MultimodalArchitecture(_ArchEnum):
    Phi3V = ("Phi3V", None)  # remote code only; transformers has no phi3_v
    Idefics2 = ("Idefics2", "idefics2")
    LLaVANext = ("LLaVANext", "llava_next")
    LLaVA = ("LLaVA", "llava")
    VLlama = ("VLlama", "mllama")
    Qwen2VL = ("Qwen2VL", "qwen2_vl")
    Idefics3 = ("Idefics3", "idefics3")
    MiniCpmO = ("MiniCpmO", None)
    Phi4MM = ("Phi4MM", "phi4_multimodal")
    Qwen2_5VL = ("Qwen2_5VL", "qwen2_5_vl")
    Gemma3 = ("Gemma3", "gemma3")
    Mistral3 = ("Mistral3", "mistral3")
    Llama4 = ("Llama4", "llama4")
    Gemma3n = ("Gemma3n", "gemma3n")
    Qwen3VL = ("Qwen3VL", "qwen3_vl")
    Qwen3VLMoE = ("Qwen3VLMoE", "qwen3_vl_moe")
    Gemma4 = ("Gemma4", "gemma4")


class EmbeddingArchitecture(_ArchEnum):
    EmbeddingGemma = ("EmbeddingGemma", "gemma3_text")
    Qwen3Embedding = ("Qwen3Embedding", "qwen3")
    Bert = ("Bert", "bert")


def mrope_refusal(what: str, param: str) -> InvalidSpecError:
    """The 400 for a vision-language family whose positions rayrunner cannot give (`MROPE_MODEL_TYPES`)."""
    return InvalidSpecError(f"{what} is not served: its image positions are M-RoPE's (the model's own rope index), "
                            "which rayrunner's scheduler does not give yet, so its answers would be wrong", param=param)


def check_arch(arch: _ArchEnum | None, model_type: str, multimodal: bool = False) -> None:
    """Fail clearly when the declared architecture is not loadable or does not match the config, or when a
    multimodal model is of a family whose positions rayrunner cannot give (`MROPE_MODEL_TYPES`; text alone has
    plain positions in them, so a text model of that type is served)."""
    if multimodal and model_type in MROPE_MODEL_TYPES:
        raise mrope_refusal(f"model_type `{model_type}`", "which")
    if arch is None:
        return
    if arch.model_type is None:
        raise InvalidSpecError(
            f"architecture `{arch.value}` cannot be loaded: transformers has no model for it", param="arch"
        )
    if arch.model_type != model_type:
        raise InvalidSpecError(
            f"architecture `{arch.value}` expects model_type `{arch.model_type}`, "
            f"but the model's config says `{model_type}`",
            param="arch",
        )
