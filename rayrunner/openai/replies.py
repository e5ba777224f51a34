"""Turn engine events into OpenAI objects: whole responses or stream chunks, with n choices and logprobs."""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rayrunner.openai.events import EmbeddingResult, GenerationEvent, TokenLogprob
from rayrunner.openai.tool_replies import ToolReplies
from rayrunner.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    ChunkChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    Delta,
    EmbeddingData,
    EmbeddingResponse,
    EmbeddingUsage,
    TopLogprob,
    Usage,
    _new_id,
)
from rayrunner.protocol import TokenLogprob as OpenAITokenLogprob


@dataclass
class _Choice:
    """One choice's events gathered: its text, its tokens' logprobs and its final event."""

    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    final: GenerationEvent | None = None

    def add(self, event: GenerationEvent) -> None:
        self.parts.append(event.text)
        self.logprobs.extend(event.logprobs or [])
        self.prompt_logprobs.extend(event.prompt_logprobs or [])
        if event.finish_reason is not None:
            self.final = event

    @property
    def text(self) -> str:
        return "".join(self.parts)


async def _collect(events: AsyncIterator[GenerationEvent]) -> list[_Choice]:
    choices: dict[int, _Choice] = {}
    async for event in events:
        choices.setdefault(event.index, _Choice()).add(event)
    if not choices or any(c.final is None for c in choices.values()):
        raise RuntimeError("engine stream ended without a final event")
    return [choices[i] for i in sorted(choices)]


def usage_of(finals: list[GenerationEvent]) -> Usage:
    """One prompt (prefilled once), every choice's completion tokens; the slowest choice's times."""
    return Usage.from_timing(
        finals[0].prompt_tokens,
        sum(e.completion_tokens for e in finals),
        max(e.prompt_time_s for e in finals),
        max(e.completion_time_s for e in finals),
        finals[0].cached_tokens,
    )


def _finals(choices: list[_Choice]) -> list[GenerationEvent]:
    return [c.final for c in choices if c.final is not None]


# ---------------------------------------------------------------- chat


def chat_logprobs(entries: list[TokenLogprob]) -> ChoiceLogprobs:
    """OpenAI's chat shape: per token its text, logprob, UTF-8 bytes and the top alternatives."""
    return ChoiceLogprobs(content=[
        OpenAITokenLogprob(
            token=e.token, logprob=e.logprob or 0.0, bytes=list(e.token.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=list(t.encode())) for t, lp in e.top],
        )
        for e in entries
    ])


async def chat_response(model: str, events: AsyncIterator[GenerationEvent], request: ChatCompletionRequest,
                        tools: ToolReplies | None = None) -> ChatCompletionResponse:
    choices = await _collect(events)
    shaped = [_chat_choice(i, c, request, tools) for i, c in enumerate(choices)]
    return ChatCompletionResponse(model=model, choices=shaped, usage=usage_of(_finals(choices)))


def _chat_choice(index: int, choice: _Choice, request: ChatCompletionRequest, tools: ToolReplies | None) -> ChatChoice:
    assert choice.final is not None
    content, calls = tools.split(choice.text) if tools else (choice.text, [])
    message = AssistantMessage(content=content, tool_calls=[c.to_tool_call() for c in calls] or None)
    return ChatChoice(index=index, message=message, finish_reason=_finish_reason(choice.final, bool(calls)),
                      logprobs=chat_logprobs(choice.logprobs) if request.logprobs else None)


def _finish_reason(final: GenerationEvent, called: bool) -> str | None:
    """`tool_calls` when the reply ended in calls (a reply cut short stays `length`)."""
    return "tool_calls" if called and final.finish_reason == "stop" else final.finish_reason


async def chat_chunks(model: str, events: AsyncIterator[GenerationEvent], request: ChatCompletionRequest,
                      tools: ToolReplies | None = None) -> AsyncIterator[ChatCompletionChunk]:
    """Per choice a role chunk, a chunk per text event (or per tool-call piece), a chunk with its finish_reason;
    usage on the last finish chunk, or in a chunk of its own with no choices when `stream_options.include_usage`
    asks for it."""
    chunk_id = _new_id("chatcmpl")
    n = request.n or 1
    # The role chunks wait for the engine's first event (as vLLM's do): an error before the first token (a prompt
    # past the KV budget) then reaches the client as its own status, not in-band after a 200.
    events = _started(await anext(aiter(events), None), events)
    for index in range(n):
        yield ChatCompletionChunk(id=chunk_id, model=model,
                                  choices=[ChunkChoice(index=index, delta=Delta(role="assistant"))])
    deltas = {index: tools.stream() for index in range(n)} if tools else {}
    finals: list[GenerationEvent] = []
    async for event in events:
        logprobs = chat_logprobs(event.logprobs) if request.logprobs and event.logprobs else None
        stream = deltas.get(event.index)
        pieces = stream.feed(event.text) if stream else [Delta(content=event.text)] if event.text else []
        if event.finish_reason is not None and stream:
            pieces += stream.finish()
        for i, delta in enumerate(pieces or ([Delta(content="")] if logprobs else [])):
            choice = ChunkChoice(index=event.index, delta=delta, logprobs=None if i else logprobs)
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[choice])
        if event.finish_reason is not None:
            finals.append(event)
            usage = usage_of(finals) if len(finals) == n and not _usage_apart(request) else None
            reason = _finish_reason(event, bool(stream and stream.calls))
            final = ChunkChoice(index=event.index, delta=Delta(), finish_reason=reason)
            yield ChatCompletionChunk(id=chunk_id, model=model, choices=[final], usage=usage)
    if _usage_apart(request):
        yield ChatCompletionChunk(id=chunk_id, model=model, choices=[], usage=usage_of(finals))


async def _started(first: GenerationEvent | None, rest: AsyncIterator[GenerationEvent]
                   ) -> AsyncIterator[GenerationEvent]:
    if first is None:
        return
    yield first
    async for event in rest:
        yield event


def _usage_apart(request: ChatCompletionRequest | CompletionRequest) -> bool:
    return request.stream_options is not None and request.stream_options.include_usage


# ---------------------------------------------------------------- completions


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """The legacy shape: parallel lists of tokens, logprobs, top alternatives and character offsets."""
    shaped = CompletionLogprobs()
    for e in entries:
        shaped.tokens.append(e.token)
        shaped.token_logprobs.append(e.logprob)
        shaped.top_logprobs.append(dict(e.top) if e.logprob is not None else None)
        shaped.text_offset.append(offset)
        offset += len(e.token)
    return shaped


async def completion_response(model: str, events: AsyncIterator[GenerationEvent],
                              request: CompletionRequest) -> CompletionResponse:
    choices = await _collect(events)
    prompt = request.prompt_text() if request.echo else ""
    shaped = [
        CompletionChoice(index=i, text=prompt + c.text, finish_reason=c.final.finish_reason,
                         logprobs=None if request.logprobs is None else
                         completion_logprobs(c.prompt_logprobs + c.logprobs, 0))
        for i, c in enumerate(choices) if c.final is not None
    ]
    return CompletionResponse(model=model, choices=shaped, usage=usage_of(_finals(choices)))


async def completion_chunks(model: str, events: AsyncIterator[GenerationEvent],
                            request: CompletionRequest) -> AsyncIterator[CompletionResponse]:
    """A chunk per text event (with `echo`, the prompt comes first in each choice's first chunk), then each choice's
    finish chunk; usage as for chat."""
    chunk_id = _new_id("cmpl")
    n = request.n or 1
    offsets = dict.fromkeys(range(n), 0)
    echoed: set[int] = set()
    finals: list[GenerationEvent] = []
    async for event in events:
        text = event.text
        entries = (event.prompt_logprobs or []) + (event.logprobs or [])
        if request.echo and event.index not in echoed:
            echoed.add(event.index)
            text = request.prompt_text() + text
        logprobs = None if request.logprobs is None else completion_logprobs(entries, offsets[event.index])
        offsets[event.index] += sum(len(e.token) for e in entries)
        if text or entries:
            choice = CompletionChoice(index=event.index, text=text, logprobs=logprobs)
            yield CompletionResponse(id=chunk_id, model=model, choices=[choice])
        if event.finish_reason is not None:
            finals.append(event)
            usage = usage_of(finals) if len(finals) == n and not _usage_apart(request) else None
            final = CompletionChoice(index=event.index, text="", finish_reason=event.finish_reason)
            yield CompletionResponse(id=chunk_id, model=model, choices=[final], usage=usage)
    if _usage_apart(request):
        yield CompletionResponse(id=chunk_id, model=model, choices=[], usage=usage_of(finals))


# ---------------------------------------------------------------- embeddings


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
