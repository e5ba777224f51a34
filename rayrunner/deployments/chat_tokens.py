"""A text model's chat request as prompt token ids, and how its replies become tool calls: shared by the engines
that serve text models (rayrunner's `TextEngine`, `VllmEngine`), so both render, constrain and parse alike.

What a client writes is text, never control tokens: a `<|im_end|>` spelt in any message's content, name or tool
call, in a tool's description or schema, or in a completion's prompt is encoded as ordinary text pieces, so only the
chat template's own markers are role markers. The chat path uses transformers' `sanitize_control_tokens` encoding,
which the multimodal engine's processor applies to its conversations too."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers.utils.chat_template_utils import _get_control_token_patterns, mark_control_tokens

from rayrunner.deployments.chat_prompt import chat_template_text, render_chat
from rayrunner.deployments.step.detokenizer import special_ids
from rayrunner.deployments.structured_output import JsonTarget
from rayrunner.deployments.tool_calls import markers, tool_format
from rayrunner.deployments.tool_replies import ToolReplies
from rayrunner.errors import UnsupportedRequestError
from rayrunner.models.spec import ModelSpec
from rayrunner.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, Tool


def user_text_marker(tokenizer: Any, template: str) -> Callable[[Any], Any]:
    """A function that marks the control tokens (the tokenizer's special tokens and the added tokens `template`
    writes) spelt in a value from the client, in its strings and dict keys alike, so that encoding the rendered
    prompt with `sanitize_control_tokens=True` writes them as text."""
    pattern, _ = _get_control_token_patterns(tokenizer._get_control_tokens(template))

    def mark(value: Any) -> Any:
        if isinstance(value, str):
            return mark_control_tokens(value, pattern)
        if isinstance(value, dict):
            return {mark(key): mark(item) for key, item in value.items()}
        if isinstance(value, list):
            return [mark(item) for item in value]
        return value

    return mark


class ChatTokens:
    """Mixed into a text engine that has `spec` and a transformers `tokenizer`."""

    spec: ModelSpec
    tokenizer: Any

    def chat_ids(self, request: ChatCompletionRequest, target: JsonTarget | None) -> list[int]:
        """The prompt of `request` (its JSON `target`'s note in the system message), generation prompt included."""
        if request.has_images():
            raise UnsupportedRequestError("this is a text model: image inputs need a multimodal model")
        template = chat_template_text(self.tokenizer, self.spec.engine.chat_template, request.tools)
        mark = user_text_marker(self.tokenizer, template)
        messages = [ChatMessage.model_validate(mark(message.model_dump())) for message in request.messages]
        tools = [Tool.model_validate(mark(tool.model_dump())) for tool in request.tools] if request.tools else None
        note = mark(target.system_note) if target and target.system_note else None
        text = render_chat(self.tokenizer, messages, tools, self.spec.engine.chat_template,
                           tool_choice_none=request.tool_choice == "none", system_note=note,
                           reasoning_effort=request.reasoning_effort)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False, sanitize_control_tokens=True)["input_ids"]
        return ids

    def completion_ids(self, request: CompletionRequest) -> list[int]:
        """The prompt of a completion, its text encoded as text (special tokens it spells stay text); the
        tokenizer's own BOS is added when `add_special_tokens` asks for it."""
        ids: list[int] = self.tokenizer(request.prompt_text(), add_special_tokens=request.add_special_tokens,
                                        split_special_tokens=True)["input_ids"]
        return ids

    def tool_replies(self, request: ChatCompletionRequest) -> ToolReplies | None:
        template = chat_template_text(self.tokenizer, self.spec.engine.chat_template, request.tools)
        return ToolReplies.of(request, tool_format(template))

    def tool_markers(self, request: ChatCompletionRequest) -> frozenset[int]:
        """The special tokens that mark a call in the model's tool format (Mistral's `[TOOL_CALLS]`), kept in an
        `auto` reply's text so the parser sees them; none for other requests."""
        replies = self.tool_replies(request) if request.tools else None
        if replies is None or replies.forced:
            return frozenset()
        return special_ids(self.tokenizer, markers(replies.fmt))
