"""The engine interface a model replica drives (the events it yields are in `rayrunner.openai.events`).

An engine owns the weights of one model inside one replica. The deployment turns the engine's events into OpenAI
objects; only the router speaks HTTP. Engines are built by `build_engine` from a `ModelSpec`, and tests may build
one directly without Ray.
"""

from __future__ import annotations

from abc import ABC
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from rayrunner.errors import InvalidRequestError, UnsupportedRequestError
from rayrunner.openai.events import EmbeddingResult, GenerationEvent
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from rayrunner.engines.loading import Loaded
    from rayrunner.engines.parked_weights import ParkedWeights
    from rayrunner.openai.sampling_params import SamplingParams
    from rayrunner.openai.tool_replies import ToolReplies

T = TypeVar("T")


@dataclass
class EngineInfo:
    """What the replica actually loaded, for `GET /v1/models/{model}`."""

    kind: str
    device: str
    dtype: str
    weight_bytes: int
    quantization: dict[str, Any] | None = None
    load_time_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def describe(kind: str, loaded: Loaded, extra: dict[str, Any]) -> EngineInfo:
    """EngineInfo of a loaded model, with its weight bytes measured now (after any quantization)."""
    from rayrunner.quantization import weight_bytes

    return EngineInfo(
        kind=kind,
        device=loaded.device,
        dtype=loaded.dtype,
        weight_bytes=weight_bytes(loaded.model),
        quantization=loaded.quantization,
        load_time_s=loaded.load_time_s,
        extra=extra,
    )


class Engine(ABC):  # noqa: B024 - every method has a default that refuses the request kind
    """One loaded model. Subclasses override the request kinds they serve; the others refuse with a 400."""

    kind: str = "text"
    loaded: Loaded  # the model and what was applied loading it, set by every engine's constructor

    def info(self) -> EngineInfo:
        raise NotImplementedError

    async def between_steps(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's compute thread while no model call runs (sleep parks the weights there)."""
        raise NotImplementedError

    async def sleep(self, parking: ParkedWeights) -> None:
        """Free the weights and keep the rest for `wake` (`EngineSlot`): by default `loaded.model`'s are parked in
        `parking`'s file between steps; engines that hold them elsewhere free them their own way."""
        model = self.loaded.model
        await self.between_steps(lambda: parking.park(model))

    async def wake(self, parking: ParkedWeights) -> None:
        """Put back what `sleep` freed; raise if it cannot (the slot then builds a new engine)."""
        await self.between_steps(parking.restore)

    def chat(self, request: ChatCompletionRequest, params: SamplingParams, adapter: str | None = None
             ) -> AsyncIterator[GenerationEvent]:
        """Generate the assistant reply to `request.messages` (events as documented on GenerationEvent), through
        the LoRA `adapter` when one is named (see `use_adapter`)."""
        raise UnsupportedRequestError(f"this is a {self.kind} model: it does not serve chat completions")

    def tool_replies(self, request: ChatCompletionRequest) -> ToolReplies | None:
        """How `request`'s replies become tool calls (None: they are plain content)."""
        if request.tools and request.tool_choice != "none":
            raise UnsupportedRequestError(f"this is a {self.kind} model: tools are served by text models",
                                          param="tools")
        return None

    def complete(self, request: CompletionRequest, params: SamplingParams, adapter: str | None = None
                 ) -> AsyncIterator[GenerationEvent]:
        """Continue `request.prompt` as plain text."""
        raise UnsupportedRequestError(f"this is a {self.kind} model: it does not serve text completions")

    async def embed(self, texts: list[str]) -> EmbeddingResult:
        """One vector per text, in order."""
        raise UnsupportedRequestError(f"this is a {self.kind} model: it does not serve embeddings")

    async def use_adapter(self, name: str, source: str | None) -> None:
        """Make LoRA adapter `name` ready, loading it from `source` (folder or hub id) if this engine lacks it."""
        raise UnsupportedRequestError(f"this is a {self.kind} model: LoRA adapters are served by text models",
                                      param="adapter")

    def check_health(self) -> None:  # noqa: B027 - optional hook
        """Raise when the engine can no longer serve (Serve's health check then replaces the replica)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the engine holds (threads, GPU memory). Weights go with the replica process."""


def bounded_max_tokens(prompt_tokens: int, max_tokens: int, context: int) -> int:
    """`max_tokens` within the model's context: a prompt that fills it, or a `max_tokens` larger than the whole
    context (it can never be honoured), is a 400; otherwise the reply is cut where the context ends (`length`)."""
    if prompt_tokens >= context:
        raise InvalidRequestError(f"the prompt has {prompt_tokens} tokens (images included); this model's context "
                                  f"is {context}", param="messages")
    if max_tokens > context:
        raise InvalidRequestError(f"max_tokens is {max_tokens}; this model's context is {context} tokens, prompt "
                                  "included", param="max_tokens")
    return min(max_tokens, context - prompt_tokens)
