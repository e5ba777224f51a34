"""Text generation engine: a causal LM from transformers, run by the step scheduler with token streaming.

LoRA adapters (`load_adapter`, or the spec's own when it is a `Which.Lora`) are served by the same model: a request
names one by `adapter`, and the scheduler mixes adapters and the base model in one batch (`lora` says how).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from transformers import AutoModelForCausalLM

from rayrunner.engines.base import Engine, EngineInfo, bounded_max_tokens, describe
from rayrunner.engines.chat_tokens import ChatTokens
from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.loading import Loaded, load_model
from rayrunner.engines.lora import LoraAdapters, adapter_folder
from rayrunner.engines.transformers.constrained import Grammars
from rayrunner.engines.transformers.step.compute_thread import ComputeThread
from rayrunner.engines.transformers.step.scheduler import StepScheduler, scheduler_limits
from rayrunner.engines.transformers.step.sequence import stop_ids
from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import ModelSpec
from rayrunner.models.which import Lora
from rayrunner.openai.events import GenerationEvent
from rayrunner.openai.sampling_params import LogitsProcessor, SamplingParams
from rayrunner.openai.structured_output import JsonTarget, json_target
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest

T = TypeVar("T")


class TextEngine(ChatTokens, Engine):
    kind = "text"

    def __init__(self, spec: ModelSpec, loaded: Loaded | None = None) -> None:
        self.spec = spec
        self.compute = ComputeThread("text-engine", spec.engine.torch_threads)
        self.loaded = loaded or self.compute.call(load_model, spec, AutoModelForCausalLM)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.eos_ids = stop_ids(self.model, self.tokenizer)
        self.grammars = Grammars(self.tokenizer, self.eos_ids, self.model.config.vocab_size)
        config_limit = getattr(self.model.config, "max_position_embeddings", 0)
        self.max_seq_len = int(spec.engine.max_seq_len or config_limit or 4096)
        self.adapters = LoraAdapters(self.model, spec.engine.max_adapters)
        self.default_adapter = self._spec_adapter(spec)
        self.scheduler = StepScheduler(self.model, scheduler_limits(spec.engine), self.adapters, spec.model_id)
        self.scheduler.start(self.compute)

    def _spec_adapter(self, spec: ModelSpec) -> str | None:
        """A `Which.Lora` spec serves its adapter, named by the model id, to requests that name none."""
        if not isinstance(spec.which, Lora):
            return None
        self.adapters.register(spec.model_id, adapter_folder(spec.which.adapter, spec.which.hf_cache_path))
        self.compute.call(self.adapters.load, spec.model_id)
        return spec.model_id

    async def use_adapter(self, name: str, source: str | None) -> None:
        if source is not None and not self.adapters.known(name):
            await self.load_adapter(name, source)

    async def load_adapter(self, name: str, source: str) -> None:
        """Load the LoRA adapter at `source` (folder or hub id) as `name`, on the compute thread between steps (a
        name already loaded from another folder is refused)."""
        folder = await asyncio.to_thread(adapter_folder, source, getattr(self.spec.which, "hf_cache_path", None))
        self.adapters.register(name, folder)
        await asyncio.wrap_future(self.scheduler.between_steps(
            lambda: self.adapters.load(name, self.scheduler.active_adapters())))

    def info(self) -> EngineInfo:
        extra = {"max_seq_len": self.max_seq_len, "model_type": self.model.config.model_type,
                 "scheduler": self.scheduler.stats(), "adapters": self.adapters.loaded,
                 "torch_threads": self.compute.cores.threads}
        return describe(self.kind, self.loaded, extra)

    def chat(self, request: ChatCompletionRequest, params: SamplingParams, adapter: str | None = None
             ) -> AsyncIterator[GenerationEvent]:
        target = json_target(request)
        ids = self.chat_ids(request, target)
        params.constraint = self._constraint(target)
        return self._generate(ids, params, adapter, self.tool_markers(request))

    def _constraint(self, target: JsonTarget | None) -> Callable[[int | None], LogitsProcessor] | None:
        """The grammar of a chat's JSON answer (a forced tool call's or the response_format's), if it has one."""
        return self.grammars.for_target(target)

    def complete(self, request: CompletionRequest, params: SamplingParams, adapter: str | None = None
                 ) -> AsyncIterator[GenerationEvent]:
        ids = self.completion_ids(request)
        return self._generate(ids, params, adapter)

    def _generate(self, ids: list[int], params: SamplingParams, adapter: str | None,
                  kept: frozenset[int] = frozenset()) -> AsyncIterator[GenerationEvent]:
        """Queue `ids` with the request's adapter (the spec's own when it names none); `kept`: special tokens its
        text keeps (`Detokenizer.of`)."""
        adapter = adapter or self.default_adapter
        if adapter is not None:
            self.adapters.check(adapter)
        if not ids:  # an empty completion prompt: nothing to condition on, and a forward pass of no tokens fails
            raise InvalidRequestError("prompt: the prompt is empty (no tokens)", param="prompt")
        params.max_tokens = bounded_max_tokens(len(ids), params.max_tokens, self.max_seq_len)
        return self.scheduler.generate(ids, params, Detokenizer.of(self.tokenizer, params, kept), self.eos_ids,
                                       adapter=adapter)

    async def between_steps(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.scheduler.between_steps(fn))

    def check_health(self) -> None:
        self.scheduler.check_health()

    def close(self) -> None:
        self.scheduler.close()
        self.compute.shutdown()
