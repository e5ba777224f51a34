"""Text generation engine: a causal LM from transformers, run by the step scheduler with token streaming."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable

from transformers import AutoModelForCausalLM

from rayrunner.deployments.chat_prompt import chat_template_text, render_chat
from rayrunner.deployments.compute_thread import ComputeThread
from rayrunner.deployments.constrained import Grammars
from rayrunner.deployments.detokenizer import Detokenizer
from rayrunner.deployments.engine import Engine, EngineInfo, GenerationEvent, describe
from rayrunner.deployments.sampling import LogitsProcessor, SamplingParams
from rayrunner.deployments.scheduler import StepScheduler, scheduler_limits
from rayrunner.deployments.sequence import stop_ids
from rayrunner.deployments.tool_replies import ToolReplies
from rayrunner.errors import InvalidRequestError, UnsupportedRequestError
from rayrunner.loading import Loaded, load_model
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from rayrunner.spec import ModelSpec
from rayrunner.tool_calls import forced_call_schema, tool_format


class TextEngine(Engine):
    kind = "text"

    def __init__(self, spec: ModelSpec, loaded: Loaded | None = None) -> None:
        self.spec = spec
        self.compute = ComputeThread("text-engine")
        self.loaded = loaded or self.compute.call(load_model, spec, AutoModelForCausalLM)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.eos_ids = stop_ids(self.model, self.tokenizer)
        config_limit = getattr(self.model.config, "max_position_embeddings", 0)
        self.max_seq_len = int(spec.engine.max_seq_len or config_limit or 4096)
        self.scheduler = StepScheduler(self.model, scheduler_limits(spec.engine))
        self.scheduler.start(self.compute)

    def info(self) -> EngineInfo:
        extra = {"max_seq_len": self.max_seq_len, "model_type": self.model.config.model_type,
                 "scheduler": self.scheduler.stats()}
        return describe(self.kind, self.loaded, extra)

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Built on the first structured request (llguidance indexes the vocabulary in ~0.2 s)."""
        return Grammars(self.tokenizer, self.eos_ids, self.model.config.vocab_size)

    def chat(self, request: ChatCompletionRequest, params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        if request.has_images():
            raise UnsupportedRequestError("this is a text model: image inputs need a multimodal model")
        text = render_chat(self.tokenizer, request.messages, request.tools, self.spec.engine.chat_template,
                           tool_choice_none=request.tool_choice == "none")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        params.constraint = self._constraint(request)
        return self._generate(ids, params)

    def tool_replies(self, request: ChatCompletionRequest) -> ToolReplies | None:
        template = chat_template_text(self.tokenizer, self.spec.engine.chat_template, request.tools)
        return ToolReplies.of(request, tool_format(template))

    def _constraint(self, request: ChatCompletionRequest) -> Callable[[], LogitsProcessor] | None:
        """A forced tool call's JSON, else the response_format's."""
        if request.tools and (request.tool_choice == "required" or isinstance(request.tool_choice, NamedToolChoice)):
            parallel = request.tool_choice == "required" and request.parallel_tool_calls is not False
            return self.grammars.json_schema(forced_call_schema(request.tools, request.tool_choice, parallel))
        return self.grammars.for_response_format(request.response_format)

    def complete(self, request: CompletionRequest, params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        ids = self.tokenizer(request.prompt_text())["input_ids"]
        return self._generate(ids, params)

    def _generate(self, ids: list[int], params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        room = self.max_seq_len - len(ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; this model's limit is {self.max_seq_len}", param="messages"
            )
        params.max_tokens = min(params.max_tokens, room)
        return self.scheduler.generate(ids, params, Detokenizer(self.tokenizer, params.stop), self.eos_ids)

    def close(self) -> None:
        self.scheduler.close()
        self.compute.shutdown()
