"""A scripted `Engine`: it emits the tokens its `Script` names, after a delay each, and fails where the script says
(at load, before the stream starts, at token k, in the health check), so the replica (`ModelServer`, `EngineSlot`)
and the router's streaming run in process, in milliseconds, without a model. It keeps the engine contract
(`rayrunner.engines.base`, `GenerationEvent`'s rules), which `tests/test_fake_engine.py` checks: one event per token,
then one final event per choice with its finish_reason and token counts; n > 1 choices interleave.

Its "weights" are a tiny torch module in `loaded.model`, so sleep and wake run the real `ParkedWeights` (a parked
engine refuses to generate). A prompt's tokens are its whitespace-separated words; stop strings and max_tokens end a
reply as they do on a real engine.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from rayrunner.engines.base import Engine, EngineInfo, bounded_max_tokens, describe
from rayrunner.engines.loading import Loaded
from rayrunner.errors import InvalidRequestError, ModelLoadError
from rayrunner.models.spec import ModelSpec
from rayrunner.openai.events import EmbeddingResult, GenerationEvent, TokenLogprob
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest

T = TypeVar("T")
LOGPROB = -0.5  # every emitted token's logprob (and its top alternative's)


@dataclass
class Script:
    """What every engine a `FakeEngines` factory builds does; a test may change it between requests."""

    tokens: list[str] = field(default_factory=lambda: ["Hello", ",", " world", "!"])
    delay_s: float = 0.0  # before each token
    finish_reason: str = "stop"  # once every token is out; `length` when max_tokens cuts the reply first
    context: int = 2048  # the model's context, prompt included (`bounded_max_tokens`)
    fail_load: str | None = None  # the engine's constructor raises ModelLoadError with this message
    refuse: Exception | None = None  # chat/complete raise it before the stream starts (a full queue, a bad request)
    fail_at: int | None = None  # the stream raises `error` before emitting token k (0: before any output)
    error: Exception = field(default_factory=lambda: RuntimeError("scripted failure"))
    unhealthy: str | None = None  # check_health raises RuntimeError with this message
    dims: int = 4  # embedding width


class FakeEngine(Engine):
    """An engine of the spec's kind that answers from `script`."""

    def __init__(self, spec: ModelSpec, script: Script) -> None:
        if script.fail_load is not None:
            raise ModelLoadError(script.fail_load)
        self.kind = spec.kind
        self.spec = spec
        self.script = script
        self.loaded = Loaded(model=torch.nn.Linear(16, 16), tokenizer=None, processor=None, device="cpu",
                             dtype="float32", quantization=None, load_time_s=0.0)
        self.compute = ThreadPoolExecutor(1, thread_name_prefix=f"fake-{spec.model_id}")
        self.adapters: set[str] = set()
        self.requests: list[SamplingParams] = []  # every generation request's params, in order
        self.streaming = 0  # streams started and not yet ended (finished, failed, or closed by their reader)
        self.closed = False

    def info(self) -> EngineInfo:
        return describe(self.kind, self.loaded, {"fake": True, "adapters": sorted(self.adapters)})

    async def between_steps(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn)

    def chat(self, request: ChatCompletionRequest, params: SamplingParams, adapter: str | None = None
             ) -> AsyncIterator[GenerationEvent]:
        if self.kind == "embedding":
            return super().chat(request, params, adapter)
        words = [word for m in request.messages for word in str(m.content or "").split()]
        return self._generate(words, params, adapter)

    def complete(self, request: CompletionRequest, params: SamplingParams, adapter: str | None = None
                 ) -> AsyncIterator[GenerationEvent]:
        if self.kind == "embedding":
            return super().complete(request, params, adapter)
        words = request.prompt_text().split()
        if not words:
            raise InvalidRequestError("prompt: the prompt is empty (no tokens)", param="prompt")
        return self._generate(words, params, adapter)

    def _generate(self, prompt: list[str], params: SamplingParams, adapter: str | None
                  ) -> AsyncIterator[GenerationEvent]:
        """The checks real engines make before the stream starts (a 400, a full queue), then the stream."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        if adapter is not None and adapter not in self.adapters:
            raise InvalidRequestError(f"LoRA adapter `{adapter}` is not loaded on this model", param="adapter")
        if self.script.refuse is not None:
            raise self.script.refuse
        params.max_tokens = bounded_max_tokens(max(len(prompt), 1), params.max_tokens, self.script.context)
        self.requests.append(params)
        return self._events(prompt, params)

    async def _events(self, prompt: list[str], params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        script = self.script
        tokens, reason = _reply(script, params)
        first = set(range(params.n))  # choices whose first event is still to come (it carries prompt_logprobs)
        self.streaming += 1
        try:
            for k, token in enumerate([*tokens, None]):
                if k < len(tokens):
                    await asyncio.sleep(script.delay_s)
                if k == script.fail_at:
                    raise script.error
                if self.loaded.model.weight is None:
                    raise RuntimeError("generating with parked weights")
                for index in range(params.n):
                    event = GenerationEvent(index=index, prompt_logprobs=_prompt_logprobs(prompt, params, index, first))
                    if token is None:
                        event.finish_reason, event.prompt_tokens, event.completion_tokens = reason, len(prompt), k
                        event.prompt_time_s, event.completion_time_s = 0.001, script.delay_s * k + 0.001
                    else:
                        event.text, event.logprobs = token, _logprobs(token, params)
                    yield event
        finally:
            self.streaming -= 1

    async def embed(self, texts: list[str]) -> EmbeddingResult:
        if self.kind != "embedding":
            return await super().embed(texts)
        if self.script.refuse is not None:
            raise self.script.refuse
        if self.script.fail_at == 0:
            raise self.script.error
        vectors = [[(zlib.crc32(f"{i}:{text}".encode()) % 1000) / 1000 for i in range(self.script.dims)]
                   for text in texts]
        return EmbeddingResult(vectors=vectors, prompt_tokens=sum(len(text.split()) for text in texts))

    async def use_adapter(self, name: str, source: str | None) -> None:
        if source is not None:
            self.adapters.add(name)

    def check_health(self) -> None:
        if self.script.unhealthy is not None:
            raise RuntimeError(self.script.unhealthy)

    def close(self) -> None:
        self.closed = True
        self.compute.shutdown(wait=True)


def _reply(script: Script, params: SamplingParams) -> tuple[list[str], str]:
    """The tokens a reply emits and why it ends: the script's tokens up to one holding a stop string (`stop`, the
    stop string's token left out), cut at max_tokens (`length`), else the script's finish_reason."""
    tokens = list(script.tokens)
    for k, token in enumerate(tokens):
        if any(stop in token for stop in params.stop):
            return tokens[:k][:params.max_tokens], "stop" if k <= params.max_tokens else "length"
    if len(tokens) > params.max_tokens:
        return tokens[:params.max_tokens], "length"
    return tokens, script.finish_reason


def _logprobs(token: str, params: SamplingParams) -> list[TokenLogprob] | None:
    if params.logprobs is None:
        return None
    return [TokenLogprob(token, LOGPROB, [(token, LOGPROB)] * params.logprobs)]


def _prompt_logprobs(prompt: list[str], params: SamplingParams, index: int, first: set[int]
                     ) -> list[TokenLogprob] | None:
    """The prompt's logprobs (the first token has none), on a choice's first event only, when asked for."""
    if index not in first:
        return None
    first.discard(index)
    if not params.prompt_logprobs:
        return None
    return [TokenLogprob(word, None if i == 0 else LOGPROB) for i, word in enumerate(prompt)]


@dataclass
class FakeEngines:
    """An `EngineFactory` (`ModelServer(spec, engine_factory=FakeEngines(script))`) that keeps what it built."""

    script: Script = field(default_factory=Script)
    built: list[FakeEngine] = field(default_factory=list)

    def __call__(self, spec: ModelSpec) -> Engine:
        engine = FakeEngine(spec, self.script)
        self.built.append(engine)
        return engine
