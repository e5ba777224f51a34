"""Text generation engine: a causal LM from transformers, with dynamic batching and token streaming."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from rayrunner.deployments.batching import DynamicBatcher, GenerationJob
from rayrunner.deployments.detokenizer import Detokenizer
from rayrunner.deployments.engine import Engine, EngineInfo, GenerationEvent, SamplingParams, describe
from rayrunner.errors import InvalidRequestError, UnsupportedRequestError
from rayrunner.loading import Loaded, load_model
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from rayrunner.spec import ModelSpec


class _Row:
    """One sequence of a running batch: turns its tokens into events until it finishes."""

    def __init__(self, job: GenerationJob, tokenizer: Any, eos_ids: set[int], started: float) -> None:
        self.job = job
        self.detok = Detokenizer(tokenizer, job.params.stop)
        self.eos_ids = eos_ids
        self.started = started
        self.first_token_at: float | None = None
        self.done = False

    def accept(self, token_id: int) -> None:
        if self.done:
            return
        if self.job.cancelled:
            self.done = True
            return
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        if token_id in self.eos_ids:
            self.detok.add(token_id)
            self._finish("stop", self.detok.flush())
            return
        text = self.detok.add(token_id)
        if self.detok.stopped:
            self._finish("stop", text)
        elif self.detok.num_tokens >= self.job.params.max_tokens:
            self._finish("length", text + self.detok.flush())
        elif text:
            self.job.emit(GenerationEvent(text=text))

    def close(self) -> None:
        """The batch ended before this row finished on its own."""
        if not self.done:
            self._finish("length", self.detok.flush())

    def _finish(self, reason: str, text: str) -> None:
        self.done = True
        end = time.perf_counter()
        first = self.first_token_at or end
        self.job.emit(
            GenerationEvent(
                text=text,
                finish_reason=reason,
                prompt_tokens=len(self.job.prompt_ids),
                completion_tokens=self.detok.num_tokens,
                prompt_time_s=first - self.started,
                completion_time_s=end - first,
            )
        )


class _BatchStreamer(BaseStreamer):
    """Receives each step's new tokens from `generate` and hands them to the rows."""

    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first passes the prompt itself
            self._prompt_seen = True
            return
        for row, token in zip(self.rows, value.reshape(-1).tolist(), strict=True):
            row.accept(int(token))

    def end(self) -> None:
        for row in self.rows:
            row.close()


class _RowsDone(StoppingCriteria):
    def __init__(self, rows: list[_Row]) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = [row.done or row.job.cancelled for row in self.rows]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class TextEngine(Engine):
    kind = "text"

    def __init__(self, spec: ModelSpec, loaded: Loaded | None = None) -> None:
        self.spec = spec
        self.loaded = loaded or load_model(spec, AutoModelForCausalLM)
        self.model = self.loaded.model
        self.tokenizer = self.loaded.tokenizer
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        config_limit = getattr(self.model.config, "max_position_embeddings", 0)
        self.max_seq_len = int(spec.engine.max_seq_len or config_limit or 4096)
        settings = spec.engine
        self._batcher = DynamicBatcher(self._run_batch, settings.max_batch_size, settings.batch_wait_ms / 1000)

    def info(self) -> EngineInfo:
        extra = {"max_seq_len": self.max_seq_len, "model_type": self.model.config.model_type}
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
        job = GenerationJob(ids, params, asyncio.get_running_loop())
        self._batcher.submit(job)
        return _events(job)

    def _run_batch(self, jobs: list[GenerationJob]) -> None:
        started = time.perf_counter()
        rows = [_Row(job, self.tokenizer, self.eos_ids, started) for job in jobs]
        inputs = self.tokenizer.pad({"input_ids": [job.prompt_ids for job in jobs]}, return_tensors="pt")
        params = jobs[0].params
        if params.seed is not None:
            torch.manual_seed(params.seed)
        with torch.inference_mode():
            self.model.generate(
                **inputs.to(self.model.device),
                max_new_tokens=max(job.params.max_tokens for job in jobs),
                streamer=_BatchStreamer(rows),
                stopping_criteria=StoppingCriteriaList([_RowsDone(rows)]),
                pad_token_id=self.tokenizer.pad_token_id,
                **params.generate_kwargs(),
            )


async def _events(job: GenerationJob) -> AsyncIterator[GenerationEvent]:
    try:
        while True:
            item = await job.events.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finish_reason is not None:
                return
    finally:
        job.cancelled = True  # the client went away (or we finished): stop spending steps on this row


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return ids
