"""OpenAI's Responses API (`POST /v1/responses`), stateless, mapped onto chat completions.

A Responses request becomes a chat completions body (`to_chat_request`); the chat answer becomes a Response object
(`to_response`) and a chat stream becomes Responses streaming events (`stream_events`), framed as SSE by
`event_frames`. Nothing is stored, so fields that refer to earlier responses are a 400.
"""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rayrunner.errors import client_error
from rayrunner.models.spec import DEFAULT_MODEL
from rayrunner.protocol import MAX_TOP_LOGPROBS, KeepAliveField, ReasoningEffort, StructuredOutputOptions


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]
    text: str


class InputImage(BaseModel):
    type: Literal["input_image"]
    image_url: str = Field(description="`data:image/...;base64,...` or an allow-listed http(s) URL (there is no "
                           "files API for `file_id`).")
    detail: Literal["low", "high", "auto", "original"] = "auto"


ContentPart = Annotated[InputText | InputImage, Field(discriminator="type")]


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[ContentPart] | str


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object, encoded as a string.")


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: list[InputText] | str


def _item_kind(value: Any) -> str | None:
    return value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_kind)]


class FunctionTool(BaseModel):
    type: Literal["function"] = "function"
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON Schema for the arguments object.")
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text`, `json_object`, or `json_schema` with the schema's fields alongside `type` (not nested as in chat)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = Field(None, max_length=64, description="json_schema: the schema's name.")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="json_schema: the JSON Schema.")
    description: str | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise PydanticCustomError("missing_schema", "a json_schema format needs `name` and `schema`")
        return self


class TextConfig(BaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ReasoningConfig(BaseModel):
    effort: ReasoningEffort | None = Field(None, description="Chat's `reasoning_effort`: the chat template's "
                                           "thinking switch.")
    summary: Literal["auto", "concise", "detailed"] | None = Field(
        None, description="Accepted; no summary is made: a thinking model's reasoning stays in the output text.")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="Older `summary`.")


LOGPROBS_INCLUDE = "message.output_text.logprobs"

# field -> (the `type`s it takes, the type of an object without one)
_SUPPORTED = {"input": (("message", "function_call", "function_call_output"), "message"),
              "tools": (("function",), "function"), "tool_choice": (("function",), "function")}


class ResponsesRequest(BaseModel):
    """`POST /v1/responses`. Unknown fields (`service_tier`, `prompt_cache_key`, ...) are accepted and ignored."""

    model: str | None = Field(None, description="Model id, alias, or `default` (also when omitted).")
    input: list[InputItem] | str = Field(description="A user message, or the conversation as a list of items: "
                                         "messages, `function_call` and `function_call_output`.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    tools: list[FunctionTool] | None = Field(None, description="Functions the model may call (only `function`).")
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = Field(None, description="`format`: `text`, `json_object` or `json_schema`.")
    max_output_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    keep_alive: KeepAliveField = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 or unset means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, description="rayrunner extension, as in chat: seed for sampling.")
    reasoning: ReasoningConfig | None = Field(None, description="`effort`: how much a reasoning model thinks.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Each output token's log "
                                     "probability, with this many most likely alternatives.")
    include: list[str] | None = Field(None, description=f"`{LOGPROBS_INCLUDE}` returns the output tokens' log "
                                      "probabilities (as `top_logprobs` does); other values are ignored.")
    truncation: Literal["auto", "disabled"] | None = Field(
        None, description="`disabled` (default) or `auto`; an input that does not fit the model's context is a 400 "
        "either way (`auto` does not drop items from its start).")
    max_tool_calls: int | None = Field(None, ge=0, description="OpenAI's cap on built-in tool calls: holds "
                                       "trivially, as only function tools are served (it does not cap those).")
    structured_output_options: StructuredOutputOptions | None = Field(
        None, description="rayrunner extension, as in chat: switches for how JSON answers are kept on the model's "
        "distribution.")
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="Accepted and ignored.")
    user: str | None = Field(None, description="As in chat: a model with `routing: prefix` keeps a user's requests "
                             "on one replica.")
    store: bool | None = Field(None, description="Accepted and ignored: nothing is stored.")
    previous_response_id: str | None = Field(None, description="Not supported (a 400): nothing is stored.")
    conversation: str | dict[str, Any] | None = Field(None, description="Not supported (a 400): nothing is stored.")
    background: bool | None = Field(None, description="Only false: there are no stored responses to poll.")

    @field_validator("previous_response_id", "conversation", "background")
    @classmethod
    def _stateless(cls, value: Any) -> Any:
        if value:
            raise PydanticCustomError("stateless", "this server is stateless: it keeps no responses, so send the "
                                      "whole conversation in `input` instead")
        return value

    @field_validator("input", "tools", "tool_choice", mode="before")
    @classmethod
    def _supported_types(cls, value: Any, info: ValidationInfo) -> Any:
        """Other input items, tools or tool choices (web_search, reasoning, ...) are a 400 that names them."""
        if value == [] and info.field_name == "input":
            raise PydanticCustomError("empty_input", "input must not be empty")
        supported, default = _SUPPORTED[str(info.field_name)]
        objects = [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, dict)]
        found = sorted({str(v.get("type", default)) for v in objects} - set(supported))
        if found:
            raise PydanticCustomError("unsupported_type", "type {found} is not supported in `{field}` (only "
                                      "{supported})", {"found": ", ".join(f"`{t}`" for t in found),
                                                       "field": info.field_name, "supported": ", ".join(supported)})
        return value


def to_chat_request(request: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body that answers `request`."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    chat: dict[str, Any] = {
        "model": request.model, "messages": system + _messages(request.input),
        "max_tokens": request.max_output_tokens, "temperature": request.temperature, "top_p": request.top_p,
        "stream": request.stream, "stream_options": {"include_usage": True} if request.stream else None,
        "tools": [_chat_tool(tool) for tool in request.tools] if request.tools else None,
        "tool_choice": _chat_tool_choice(request.tool_choice), "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": _chat_format(request.text), "keep_alive": request.keep_alive, "seed": request.seed,
        "structured_output_options": request.structured_output_options, "user": request.user,
        "reasoning_effort": request.reasoning.effort if request.reasoning else None,
    }
    if wants_logprobs(request):
        chat.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    return {key: value for key, value in chat.items() if value is not None}


def wants_logprobs(request: ResponsesRequest) -> bool:
    return request.top_logprobs is not None or LOGPROBS_INCLUDE in (request.include or [])


def _messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem] | str) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _chat_content(item.content)})
        elif isinstance(item, FunctionCallItem):
            _assistant_turn(messages)["tool_calls"].append(
                {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
        else:
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a function call belongs to: the last message when it is the assistant's (a turn's
    text and calls are separate items here, one message in chat), else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": None})
    messages[-1].setdefault("tool_calls", [])
    return messages[-1]


def _chat_content(content: str | list[InputText | InputImage]) -> str | list[dict[str, Any]]:
    """A string when every part is text, else chat content parts."""
    if isinstance(content, str):
        return content
    if all(isinstance(part, InputText) for part in content):
        return "".join(part.text for part in content if isinstance(part, InputText))
    return [_chat_part(part) for part in content]


def _chat_part(part: InputText | InputImage) -> dict[str, Any]:
    if isinstance(part, InputText):
        return {"type": "text", "text": part.text}
    return {"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}}


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    return {"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}


def _chat_tool_choice(choice: str | FunctionChoice | None) -> str | dict[str, Any] | None:
    if isinstance(choice, FunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _chat_format(text: TextConfig | None) -> dict[str, Any] | None:
    if text is None or text.format.type == "text":
        return None
    if text.format.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": text.format.model_dump(by_alias=True, exclude={"type"},
                                                                           exclude_none=True)}


def to_response(chat: dict[str, Any], request: ResponsesRequest) -> dict[str, Any]:
    """The Response object for a chat completion's first choice: what streaming it would end with, so both paths
    build output items the same way."""
    choice = chat["choices"][0]
    message = choice["message"]
    calls = [{**call, "index": i} for i, call in enumerate(message.get("tool_calls") or [])]
    delta = {"content": message.get("content"), "tool_calls": calls}
    stream = _EventStream(request)
    stream.feed({"model": chat["model"], "usage": chat.get("usage"), "choices": [
        {"delta": delta, "finish_reason": choice.get("finish_reason"), "logprobs": choice.get("logprobs")}]})
    return dict(stream.finish()[-1]["response"])


def _response(response_id: str, created_at: int, model: str, request: ResponsesRequest, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    """A Response object, echoing the request's settings as OpenAI does."""
    choice = request.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": model, "output": output, "usage": None if usage is None else _usage(usage),
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "temperature": request.temperature, "top_p": request.top_p,
        "text": {"format": (request.text or TextConfig()).format.model_dump(by_alias=True, exclude_none=True)},
        "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else choice or "auto",
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None, "background": False, "metadata": request.metadata or {}, "user": request.user,
        "reasoning": request.reasoning.model_dump() if request.reasoning else None,
        "top_logprobs": request.top_logprobs, "truncation": request.truncation or "disabled",
        "max_tool_calls": request.max_tool_calls,
    }


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    input_tokens, output_tokens = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _logprobs(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat choice's token logprobs in the Responses shape (`bytes` always given)."""
    return [_logprob(entry, top=True) for entry in (choice.get("logprobs") or {}).get("content") or []]


def _logprob(entry: dict[str, Any], top: bool = False) -> dict[str, Any]:
    token = entry["token"]
    out = {"token": token, "bytes": entry.get("bytes") or list(token.encode()), "logprob": entry["logprob"]}
    return {**out, "top_logprobs": [_logprob(alt) for alt in entry.get("top_logprobs") or []]} if top else out


class _EventStream:
    """Turns chat chunks into Responses events. The first chunk starts the response (created, in_progress); one
    output item is open at a time (the message's text, or one function call) and is closed before the next opens;
    `sequence_number` counts every event. Events carry copies, so later changes never reach a sent event."""

    def __init__(self, request: ResponsesRequest) -> None:
        self.request = request
        self.response_id, self.created_at, self.model = _new_id("resp"), int(time.time()), (
            request.model or DEFAULT_MODEL)
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed, the last of `output`
        self.text = ""  # the open message's text so far
        self.logprobs: list[dict[str, Any]] = []  # and its tokens' logprobs
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}

    def snapshot(self, status: str) -> dict[str, Any]:
        return _response(self.response_id, self.created_at, self.model, self.request, status, self.output,
                         self.usage)

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._start(chunk.get("model") or self.model)
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"], _logprobs(choice))
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The last events: `response.completed`, or `response.incomplete` when the output hit its token limit."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        events = self._start(self.model) + ([] if self.output else self._text(""))  # an empty answer: empty text
        events += self._close(status)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.snapshot(status))]

    def failed(self, exc: BaseException) -> dict[str, Any]:
        error = client_error(exc, self.model)
        return self.event("error", code=error.code, message=error.message, param=error.param)

    def _start(self, model: str) -> list[dict[str, Any]]:
        if self.sequence:
            return []
        self.model = model
        return [self.event("response.created", response=self.snapshot("in_progress")),
                self.event("response.in_progress", response=self.snapshot("in_progress"))]

    def _text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != "message":
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            events = self._close("completed") + self._add(item)
            events.append(self.event("response.content_part.added", **self._where(), part=_text_part("")))
            self.text, self.logprobs = "", []
        if delta:
            self.text += delta
            self.logprobs += logprobs or []
            events.append(self.event("response.output_text.delta", **self._where(), delta=delta,
                                     logprobs=logprobs or []))
        return events

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A piece of a tool call: its first opens a function_call item; arguments stream into the open one (chat
        streams send each call whole before the next)."""
        events = []
        function = call.get("function") or {}
        if call["index"] not in self.calls:
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": call.get("id") or _new_id("call"),
                    "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
            events = self._close("completed") + self._add(item)
            self.calls[call["index"]] = item
        item = self.calls[call["index"]]
        if function.get("arguments") and item is self.open:
            item["arguments"] += function["arguments"]
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=len(self.output) - 1, delta=function["arguments"]))
        return events

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"] if self.open else "", "output_index": len(self.output) - 1,
                "content_index": 0}

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The done events of the open item, which takes its final shape in `output`."""
        item = self.open
        if item is None:
            return []
        if item["type"] == "message":
            item["content"] = [_text_part(self.text, self.logprobs)]
            events = [self.event("response.output_text.done", **self._where(), text=self.text,
                                 logprobs=self.logprobs),
                      self.event("response.content_part.done", **self._where(), part=item["content"][0])]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item["id"],
                                 output_index=len(self.output) - 1, arguments=item["arguments"])]
        item["status"] = status
        self.open = None
        return events + [self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)]


async def stream_events(chunks: AsyncIterator[dict[str, Any]], request: ResponsesRequest
                        ) -> AsyncIterator[dict[str, Any]]:
    """Responses streaming events for a chat stream (see `_EventStream`). A failure after the start becomes an
    `error` event that ends the stream."""
    stream = _EventStream(request)
    try:
        async for chunk in chunks:
            for event in stream.feed(chunk):
                yield event
        for event in stream.finish():
            yield event
    except Exception as exc:  # headers are sent already: report the error in-band, then end the stream
        yield stream.failed(exc)


async def event_frames(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """SSE as OpenAI sends Responses events: `event: <type>` and `data: <json>`, with no `[DONE]`."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
