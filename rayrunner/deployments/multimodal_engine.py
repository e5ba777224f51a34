"""Chat with a vision-language model (image + text in, text out) through its transformers processor.

OpenAI messages become the processor's chat format (`{"type": "image"}` placeholders beside text parts); the
processor's own chat template and image preprocessing build the model inputs. `generate` runs in a worker thread and
its text streams back through transformers' `AsyncTextIteratorStreamer`, so events reach the client as they are made.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from PIL import Image
from transformers import AsyncTextIteratorStreamer, AutoModelForImageTextToText, StoppingCriteria

from rayrunner.deployments.detokenizer import StopFilter
from rayrunner.deployments.engine import Engine, EngineInfo, GenerationEvent, SamplingParams, describe
from rayrunner.deployments.images import load_images
from rayrunner.errors import InvalidRequestError
from rayrunner.loading import load_model
from rayrunner.protocol import ChatCompletionRequest, ChatMessage, ImagePart
from rayrunner.spec import ModelSpec

Conversation = list[dict[str, Any]]


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


class _Streamer(AsyncTextIteratorStreamer):
    """Also notes when the first new token arrived, to split prompt time from completion time."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.started_at = 0.0
        self.first_token_at: float | None = None
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        # `generate` puts the prompt first, then each new token.
        if self._prompt_seen and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self._prompt_seen = True
        super().put(value)


class _Cancelled(StoppingCriteria):
    """Stops `generate` at the next step once the request has gone (client disconnect, stop string seen)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class MultimodalEngine(Engine):
    """One image-text-to-text model; serves `chat` (with or without images)."""

    kind = "multimodal"

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self._loaded = load_model(spec, AutoModelForImageTextToText, with_processor=True)
        self._model = self._loaded.model
        self._processor = self._loaded.processor
        self._tokenizer = self._processor.tokenizer
        # One generation at a time: `generate` serves a single request per call and already uses every core,
        # and holding the lock while seeding keeps seeded sampling reproducible.
        self._lock = threading.Lock()

    def info(self) -> EngineInfo:
        return describe(self.kind, self._loaded, {"model_type": self._model.config.model_type})

    async def chat(self, request: ChatCompletionRequest, params: SamplingParams) -> AsyncIterator[GenerationEvent]:
        conversation, urls = to_conversation(request.messages)
        images = await load_images(urls, self.spec.engine)
        inputs = await asyncio.to_thread(self._inputs, conversation, images)
        prompt_tokens = int(inputs["input_ids"].shape[1])
        max_new = self._max_new_tokens(prompt_tokens, params)
        streamer = _Streamer(self._tokenizer)
        cancel = threading.Event()
        stop = StopFilter(params.stop)
        task = asyncio.ensure_future(asyncio.to_thread(self._generate, inputs, params, max_new, streamer, cancel))
        try:
            async for text in streamer:
                ready = stop.push(text)
                if ready:
                    yield GenerationEvent(text=ready)
                if stop.stopped:
                    cancel.set()
                    break
            new_ids = (await task)[0, prompt_tokens:].tolist()
        finally:
            cancel.set()
        yield self._final_event(stop, new_ids, max_new, prompt_tokens, streamer)

    def _inputs(self, conversation: Conversation, images: list[Image.Image]) -> Any:
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
        ).to(self._loaded.device)

    def _max_new_tokens(self, prompt_tokens: int, params: SamplingParams) -> int:
        limit = self.spec.engine.max_seq_len
        if limit is None:
            return params.max_tokens
        if prompt_tokens >= limit:
            raise InvalidRequestError(
                f"the prompt is {prompt_tokens} tokens (images included); this model's limit is {limit}",
                param="messages",
            )
        return min(params.max_tokens, limit - prompt_tokens)

    def _generate(
        self, inputs: Any, params: SamplingParams, max_new: int, streamer: _Streamer, cancel: threading.Event
    ) -> torch.Tensor:
        try:
            with self._lock, torch.inference_mode():
                streamer.started_at = time.perf_counter()
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                return self._model.generate(
                    **inputs,
                    **params.generate_kwargs(),
                    max_new_tokens=max_new,
                    streamer=streamer,
                    stopping_criteria=[_Cancelled(cancel)],
                    stop_strings=params.stop or None,
                    tokenizer=self._tokenizer,
                    pad_token_id=self._tokenizer.pad_token_id,
                )
        except BaseException:
            streamer.end()  # wake the reader; the exception reaches it through the task
            raise

    def _final_event(
        self, stop: StopFilter, new_ids: list[int], max_new: int, prompt_tokens: int, streamer: _Streamer
    ) -> GenerationEvent:
        tail = "" if stop.stopped else stop.flush()
        eos = self._model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos])
        ended = stop.stopped or bool(new_ids and new_ids[-1] in eos_ids)
        finish = "length" if not ended and len(new_ids) >= max_new else "stop"
        now = time.perf_counter()
        first = streamer.first_token_at or now
        return GenerationEvent(
            text=tail,
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(new_ids),
            prompt_time_s=first - streamer.started_at,
            completion_time_s=now - first,
        )
