"""Text generation engine: a causal LM from transformers, run by the step scheduler with token streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from transformers import AutoModelForCausalLM

from rayrunner.deployments.compute_thread import ComputeThread
from rayrunner.deployments.detokenizer import Detokenizer
from rayrunner.deployments.engine import Engine, EngineInfo, GenerationEvent, describe
from rayrunner.deployments.sampling import SamplingParams
from rayrunner.deployments.scheduler import StepScheduler, scheduler_limits
from rayrunner.deployments.sequence import stop_ids
from rayrunner.errors import InvalidRequestError, UnsupportedRequestError
from rayrunner.loading import Loaded, load_model
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from rayrunner.spec import ModelSpec


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

    def chat(self, request: ChatCompletionRequest, params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        if request.has_images():
            raise UnsupportedRequestError("this is a text model: image inputs need a multimodal model")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, chat_template=self.spec.engine.chat_template
            )
        except Exception as exc:
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._generate(ids, params)

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
