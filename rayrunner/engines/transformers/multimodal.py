"""Chat with a vision-language model (image + text in, text out) through its transformers processor.

OpenAI messages become the processor's chat format (`{"type": "image"}` placeholders beside text parts); the
processor's own chat template and image preprocessing build the model inputs. The step scheduler runs the requests
like the text engine's: each prompt (its images included) is prefilled in one pass, then its sequence decodes in the
shared batch with everyone else's.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from PIL import Image
from transformers import AutoModelForImageTextToText

from rayrunner.engines.base import Engine, EngineInfo, bounded_max_tokens, describe
from rayrunner.engines.detokenizer import Detokenizer
from rayrunner.engines.loading import load_model
from rayrunner.engines.transformers.constrained import Grammars
from rayrunner.engines.transformers.step.compute_thread import ComputeThread, run_single_threaded
from rayrunner.engines.transformers.step.scheduler import StepScheduler, scheduler_limits
from rayrunner.engines.transformers.step.sequence import stop_ids
from rayrunner.models.spec import ModelSpec
from rayrunner.openai.chat_prompt import reasoning_switches
from rayrunner.openai.events import GenerationEvent
from rayrunner.openai.images import load_images
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.openai.structured_output import json_target
from rayrunner.protocol import ChatCompletionRequest, ChatMessage, ImagePart

Conversation = list[dict[str, Any]]
T = TypeVar("T")


def to_conversation(messages: list[ChatMessage]) -> tuple[Conversation, list[str]]:
    """The processor's chat format, and the image URLs in the order their placeholders appear."""
    conversation: Conversation = []
    for message in messages:
        if isinstance(message.content, list):
            parts = [
                {"type": "image"} if isinstance(part, ImagePart) else {"type": "text", "text": part.text}
                for part in message.content
            ]
        else:
            parts = [{"type": "text", "text": message.content or ""}]
        # `developer` is OpenAI's newer name for `system`; model templates only know the latter.
        role = "system" if message.role == "developer" else message.role
        conversation.append({"role": role, "content": parts})
    urls = [url for message in messages for url in message.image_urls()]
    return conversation, urls


class MultimodalEngine(Engine):
    """One image-text-to-text model; serves `chat` (with or without images)."""

    kind = "multimodal"

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.compute = ComputeThread("multimodal-engine", spec.engine.torch_threads)
        self.loaded = self.compute.call(load_model, spec, AutoModelForImageTextToText, True)
        self._model = self.loaded.model
        self._processor = self.loaded.processor
        self._tokenizer = self._processor.tokenizer
        self._eos_ids = stop_ids(self._model, self._tokenizer)
        self.grammars = Grammars(self._tokenizer, self._eos_ids, self._model.config.get_text_config().vocab_size)
        self.scheduler = StepScheduler(self._model, scheduler_limits(spec.engine), model_id=spec.model_id)
        self.scheduler.start(self.compute)

    def info(self) -> EngineInfo:
        extra = {"model_type": self._model.config.model_type, "scheduler": self.scheduler.stats(),
                 "torch_threads": self.compute.cores.threads}
        return describe(self.kind, self.loaded, extra)

    async def chat(self, request: ChatCompletionRequest, params: SamplingParams, adapter: str | None = None
                   ) -> AsyncIterator[GenerationEvent]:
        if adapter is not None:
            await self.use_adapter(adapter, None)  # refuses: no adapters on multimodal models
        params.constraint = self.grammars.for_target(json_target(request))
        conversation, urls = to_conversation(request.messages)
        images = await load_images(urls, self.spec.engine)
        inputs = await run_single_threaded(self._inputs, conversation, images, request.reasoning_effort)
        prompt_ids = inputs["input_ids"][0].tolist()
        params.max_tokens = self._max_new_tokens(len(prompt_ids), params)
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        detokenizer = Detokenizer.of(self._tokenizer, params)
        async for event in self.scheduler.generate(prompt_ids, params, detokenizer, self._eos_ids, extra):
            yield event

    def _inputs(self, conversation: Conversation, images: list[Image.Image], reasoning_effort: str | None = None
                ) -> Any:
        template = self.spec.engine.chat_template or self._processor.chat_template
        return self._processor.apply_chat_template(
            conversation,
            chat_template=self.spec.engine.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            # User text may not write control tokens, so it cannot add image placeholders of its own.
            sanitize_control_tokens=True,
            processor_kwargs={"images": images},
            **reasoning_switches(str(template) if template else None, reasoning_effort),
        ).to(self.loaded.device)

    def _max_new_tokens(self, prompt_tokens: int, params: SamplingParams) -> int:
        limit = self.spec.engine.max_seq_len
        return params.max_tokens if limit is None else bounded_max_tokens(prompt_tokens, params.max_tokens, limit)

    async def between_steps(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.scheduler.between_steps(fn))

    def check_health(self) -> None:
        self.scheduler.check_health()

    def close(self) -> None:
        self.scheduler.close()
        self.compute.shutdown()
