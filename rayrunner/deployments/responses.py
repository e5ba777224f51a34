"""Turn engine events into OpenAI objects: whole responses or stream chunks."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator

from rayrunner.deployments.engine import EmbeddingResult, GenerationEvent
from rayrunner.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChunkChoice,
    CompletionChoice,
    CompletionResponse,
    Delta,
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    Usage,
    _new_id,
)


def usage_of(event: GenerationEvent) -> Usage:
    return Usage.from_timing(
        event.prompt_tokens, event.completion_tokens, event.prompt_time_s, event.completion_time_s
    )


async def _collect(events: AsyncIterator[GenerationEvent]) -> tuple[str, GenerationEvent]:
    parts: list[str] = []
    async for event in events:
        parts.append(event.text)
        if event.finish_reason is not None:
            return "".join(parts), event
    raise RuntimeError("engine stream ended without a final event")


async def chat_response(model: str, events: AsyncIterator[GenerationEvent]) -> ChatCompletionResponse:
    text, last = await _collect(events)
    choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason)
    return ChatCompletionResponse(model=model, choices=[choice], usage=usage_of(last))


async def chat_chunks(model: str, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[ChatCompletionChunk]:
    """A role chunk, one chunk per text event, then a final chunk with finish_reason and usage."""
    chunk_id = _new_id("chatcmpl")
    yield ChatCompletionChunk(id=chunk_id, model=model, choices=[ChunkChoice(delta=Delta(role="assistant"))])
    async for event in events:
        if event.text:
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[ChunkChoice(delta=Delta(content=event.text))])
        if event.finish_reason is not None:
            final = ChunkChoice(delta=Delta(), finish_reason=event.finish_reason)
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[final], usage=usage_of(event))


async def completion_response(model: str, events: AsyncIterator[GenerationEvent]) -> CompletionResponse:
    text, last = await _collect(events)
    choice = CompletionChoice(text=text, finish_reason=last.finish_reason)
    return CompletionResponse(model=model, choices=[choice], usage=usage_of(last))


async def completion_chunks(model: str, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[CompletionResponse]:
    chunk_id = _new_id("cmpl")
    async for event in events:
        if event.text:
            yield CompletionResponse(id=chunk_id, model=model, choices=[CompletionChoice(text=event.text)])
        if event.finish_reason is not None:
            final = CompletionChoice(text="", finish_reason=event.finish_reason)
            yield CompletionResponse(id=chunk_id, model=model, choices=[final], usage=usage_of(event))


def embedding_response(model: str, result: EmbeddingResult, encoding_format: str) -> EmbeddingResponse:
    """`float` lists, or `base64` of little-endian float32 like OpenAI."""
    data = [
        EmbeddingData(index=i, embedding=_encode(vector, encoding_format)) for i, vector in enumerate(result.vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens)
    return EmbeddingResponse(model=model, data=data, usage=usage)


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector
