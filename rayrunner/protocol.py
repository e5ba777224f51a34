"""OpenAI-compatible request/response schema and the admin API bodies.

Pure pydantic: this module imports nothing from torch, transformers or ray, so clients and the router can use it
without pulling in an engine.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from rayrunner.models.keep_alive import KeepAlive, checked_keep_alive
from rayrunner.models.spec import DEFAULT_MODEL
from rayrunner.unsupported_fields import (
    OpenAIChatUnsupported,
    VllmChatUnsupported,
    VllmCompletionUnsupported,
    not_yet,
    not_yet_doc,
)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class _Lenient(BaseModel):
    """OpenAI bodies: unknown fields (e.g. `metadata`) are accepted and ignored, like OpenAI does."""

    model_config = ConfigDict(extra="ignore")


TokenId = Annotated[int, Field(ge=0)]
KeepAliveField = Annotated[KeepAlive, AfterValidator(checked_keep_alive), Field(
    None, description='Ollama\'s keep_alive: how long the model stays loaded after this request ("5m", "30s", '
    "seconds, -1 forever, 0 unload right after); unset: the model's own.")]
MAX_CHOICES = 16
MAX_TOP_LOGPROBS = 20
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(_Lenient):
    include_usage: bool = Field(False, description="Send a last chunk with no choices and the request's usage.")


# ---------------------------------------------------------------- chat messages


class ImageURL(BaseModel):
    url: str = Field(description="`data:image/...;base64,...` or an http(s) URL (refused unless allow-listed).")
    detail: str | None = None


class TextPart(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURL


# Tagged by `type`: a part without one, or of a kind not listed, is a 400 naming it (never read as text).
ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="The call's arguments as a JSON object, encoded as a string.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: list[ContentPart] | str | None = None  # the list first: its errors are the ones worth reporting
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant message's calls (history).")
    tool_call_id: str | None = Field(None, description="A `tool` message: the id of the call it answers.")

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # only an assistant's (tool-calling) turn may omit it
            raise ValueError(f"a `{self.role}` message needs `content`")
        return self

    def text(self) -> str:
        """The message's text, with image parts left out."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]


# ---------------------------------------------------------------- sampling


class SamplingFields(_Lenient):
    """Generation settings shared by chat and text completions."""

    model: str = Field(DEFAULT_MODEL, description="Model id, alias, or `default`.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 or unset means greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="Nucleus sampling: keep the smallest set of "
                                "tokens whose probabilities add up to top_p (unset: 1, keep all).")
    top_k: int | None = Field(None, ge=0, description="Keep only the k most likely tokens (0 or unset: all).")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="Drop tokens whose probability is below min_p "
                                "times the most likely token's (0 or unset: off).")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="OpenAI: subtracted from the logit "
                                           "of every token that already appeared in the output (0 or unset: off).")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="OpenAI: times a token's count "
                                            "in the output so far, subtracted from its logit (0 or unset: off).")
    repetition_penalty: float | None = Field(None, gt=0.0, description="HF/vLLM: the logit of a token seen in the "
                                             "prompt or output is divided by this when positive, multiplied when "
                                             "negative; > 1 discourages repeats (1 or unset: off).")
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="Token id (a string key in JSON) -> bias in [-100, 100] added to that token's logit; "
        "-100 bans the token, 100 all but forces it.")
    stop: str | list[str] | None = Field(None, description="Stop before any of these strings (not included).")
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extension: stop once one of these token "
                                                 "ids is generated.")
    ignore_eos: bool = Field(False, description="vLLM extension: the model's end-of-sequence tokens do not end the "
                             "reply (max_tokens, stop strings and stop_token_ids still do); benchmarks use it to fix "
                             "output lengths.")
    min_tokens: int = Field(0, ge=0, description="vLLM extension: until this many tokens are out, EOS and "
                            "stop_token_ids are masked and stop strings do not end the reply (at most max_tokens).")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string (or the stop "
                                             "token's text) that ended the reply.")
    skip_special_tokens: bool = Field(True, description="vLLM extension: false keeps special tokens in the text.")
    seed: int | None = Field(None, description="Seed for sampling, for repeatable answers.")
    n: int | None = Field(1, ge=1, le=MAX_CHOICES, description="Choices to generate from the one prompt (its "
                          f"prefill is shared), at most {MAX_CHOICES}; a seed gives choice i the seed + i.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    keep_alive: KeepAliveField = None
    user: str | None = Field(None, description="OpenAI: the end user; a model with `routing: prefix` keeps a user's "
                             "requests on one replica.")
    cache_salt: str | None = Field(None, min_length=1, description="vLLM: prefix-cache blocks are reused only "
                                   "between requests with the same salt (tenants' prompts stay apart).")

    @field_validator("model", mode="before")
    @classmethod
    def _default_model(cls, value: Any) -> Any:
        return DEFAULT_MODEL if value is None or value == "" else value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class JsonSchemaFormat(BaseModel):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="A JSON Schema.")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs `json_schema`")
        return self


class StructuredOutputOptions(BaseModel):
    """rayrunner extension: how a JSON answer (`response_format`, or a forced tool call's arguments) is kept on the
    model's distribution. Each default was chosen by measurement (rayrunner/openai/structured_output.py says
    which figures); a field set here switches that behaviour for this request only."""

    model_config = ConfigDict(extra="forbid")

    state_schema: bool = Field(True, description="Tell the model the schema in the system message (appended to the "
                               "client's, or as a new one), compact and without `title`s, unless a message already "
                               "quotes every top-level key: a `json_schema` format's, or the arguments' of a forced "
                               "call of one function.")
    strict_objects: bool = Field(True, description="An object schema with `properties` and no "
                                 "`additionalProperties` allows no other keys (OpenAI strict mode's rule and "
                                 "xgrammar's default; JSON Schema itself allows any). Tool arguments too.")
    max_string_length: int | None = Field(
        256, ge=1, le=1_000_000, description="`maxLength` for strings whose schema sets none (nor `enum`, `const`, "
        "`pattern` or `format`); null: unbounded.")
    max_array_items: int | None = Field(
        16, ge=1, le=1_000_000, description="`maxItems` for arrays whose schema sets none; null: unbounded.")
    free_objects: Literal["bounded", "open"] = Field(
        "bounded", description="Objects the schema leaves free (`json_object`, `{\"type\": \"object\"}`): `bounded` "
        "keys are identifiers (a letter or `_`, then letters, digits or `_`, 32 characters at most), at most "
        "max_array_items of them, and their values' strings and arrays are bounded as above; `open`: any object.")
    whitespace: Literal["compact", "flexible"] = Field("compact", description="`compact`: JSON as `json.dumps` "
                                                       'writes it, `{"a": 1, "b": [2, 3]}`, and no other '
                                                       "whitespace; `flexible`: up to 16 whitespace characters in "
                                                       "each gap between JSON tokens.")


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="A JSON Schema for the arguments object.")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, OpenAIChatUnsupported, VllmChatUnsupported):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Same as max_tokens (wins over it).")
    logprobs: bool | None = Field(None, description="Return each output token's log probability.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Also return this many most "
                                     "likely alternatives at each position (needs logprobs).")
    response_format: ResponseFormat | None = Field(None, description="`text`, `json_object` (any JSON object) or "
                                                   "`json_schema` (output valid for the schema).")
    structured_output_options: StructuredOutputOptions | None = Field(
        None, description="rayrunner extension: switches for how JSON answers (`response_format`, forced tool "
        "calls) are kept on the model's distribution; unset: every default.")
    tools: list[Tool] | None = Field(None, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="`auto` (default with tools), `none`, `required`, or one named function.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one answer (default true).")
    reasoning_effort: ReasoningEffort | None = Field(
        None, description="How much a reasoning model thinks: the chat template's `reasoning_effort` variable (as "
        "vLLM passes it; gpt-oss reads it), and Qwen3's `enable_thinking` switch where the template has one (off "
        "for `none` and `minimal`, else on); a template that reads neither ignores it.")
    functions: Annotated[list[dict[str, Any]] | None, not_yet([], None)] = Field(
        None, description=not_yet_doc("Deprecated form of tools."))
    function_call: Annotated[str | dict[str, Any] | None, not_yet("none", None)] = Field(
        None, description=not_yet_doc("Deprecated form of tool_choice."))

    @model_validator(mode="after")
    def _merge_max_tokens(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice `required` needs tools")
        return self

    def has_images(self) -> bool:
        return any(m.image_urls() for m in self.messages)


class CompletionRequest(SamplingFields, VllmCompletionUnsupported):
    prompt: str | list[str] = Field(description="One prompt (a list must hold exactly one).")
    max_tokens: int | None = Field(None, ge=0, description="Most tokens to generate (0 only with echo: score the "
                                   "prompt).")
    echo: bool | None = Field(None, description="Return the prompt before the completion (with its logprobs "
                              "when logprobs is set; the first token has none).")
    add_special_tokens: bool = Field(True, description="vLLM extension: add the tokenizer's special tokens (BOS) "
                                     "to the prompt.")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="Return each token's log "
                                 "probability and this many most likely alternatives.")
    best_of: Annotated[int | None, not_yet(1, None)] = Field(
        None, description=not_yet_doc("Generate this many and return the best."))
    suffix: Annotated[str | None, not_yet(None, "")] = Field(
        None, description=not_yet_doc("Text that follows the completion (insertion)."))

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("only one prompt per request is supported")
        return value

    @model_validator(mode="after")
    def _zero_tokens_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 is only meaningful with echo (to score the prompt)")
        return self

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class EmbeddingRequest(_Lenient):
    model: str = DEFAULT_MODEL
    input: str | list[str] = Field(description="One text or a list of texts.")
    encoding_format: Literal["float", "base64"] = "float"
    keep_alive: KeepAliveField = None

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("input must not be empty")
        return value

    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    """Token counts (OpenAI's, with `prompt_tokens_details.cached_tokens`) plus mistral.rs-style timing."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    avg_tok_per_sec: float = 0.0
    avg_prompt_tok_per_sec: float = 0.0
    avg_compl_tok_per_sec: float = 0.0
    total_time_sec: float = 0.0
    total_prompt_time_sec: float = 0.0
    total_completion_time_sec: float = 0.0

    @classmethod
    def from_timing(cls, prompt_tokens: int, completion_tokens: int, prompt_s: float, completion_s: float,
                    cached_tokens: int = 0) -> Usage:
        total_s = prompt_s + completion_s
        total = prompt_tokens + completion_tokens

        def rate(n: int, s: float) -> float:
            return n / s if s > 0 else 0.0

        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=total,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
            avg_tok_per_sec=rate(total, total_s),
            avg_prompt_tok_per_sec=rate(prompt_tokens, prompt_s),
            avg_compl_tok_per_sec=rate(completion_tokens, completion_s),
            total_time_sec=total_s,
            total_prompt_time_sec=prompt_s,
            total_completion_time_sec=completion_s,
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = Field(None, description="`name` in the first piece, then `arguments` text.")


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: _new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


# ---------------------------------------------------------------- errors and admin API


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ModelIdBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(min_length=1)


class UnloadBody(ModelIdBody):
    mode: Literal["stop", "sleep"] = Field("stop", description="`stop`: scale the model to zero replicas; `sleep`: "
                                           "keep the replica process, free its weights (a faster wake).")


class ScaleBody(ModelIdBody):
    num_replicas: int | None = Field(None, description="Replicas while loaded (replaces an autoscaling_config).")
    autoscaling_config: dict[str, Any] | None = Field(None, description="Serve's autoscaling (replaces "
                                                      "num_replicas).")
    routing: Literal["least_loaded", "prefix"] | None = Field(None, description="Which replica takes a request.")

    def changes(self) -> dict[str, Any]:
        return self.model_dump(exclude={"model_id"}, exclude_none=True)


class AliasBody(ModelIdBody):
    alias: str = Field(min_length=1)


class AddModelBody(BaseModel):
    """`POST /v1/models/add`: the same fields as `Runner.add_model`."""

    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(min_length=1)
    which: dict[str, Any] = Field(description="A `Which` descriptor, e.g. {'type': 'plain', 'model_id': '...'}.")
    in_situ_quant: str | None = None
    aliases: list[str] = Field(default_factory=list)
    load: bool = True
    engine: dict[str, Any] = Field(default_factory=dict, description="EngineSettings overrides.")
    pinned: bool = Field(False, description="Never evicted to make room for other models.")
    keep_alive: KeepAliveField = None


class ModelStatusBody(BaseModel):
    model_id: str
    status: str
