"""A text model's chat request as prompt token ids, and how its replies become tool calls: shared by the engines
that serve text models (rayrunner's `TextEngine`, `VllmEngine`), so both render, constrain and parse alike."""

from __future__ import annotations

from typing import Any

from rayrunner.deployments.chat_prompt import chat_template_text, render_chat
from rayrunner.deployments.step.detokenizer import special_ids
from rayrunner.deployments.structured_output import JsonTarget
from rayrunner.deployments.tool_calls import markers, tool_format
from rayrunner.deployments.tool_replies import ToolReplies
from rayrunner.errors import UnsupportedRequestError
from rayrunner.models.spec import ModelSpec
from rayrunner.protocol import ChatCompletionRequest


class ChatTokens:
    """Mixed into a text engine that has `spec` and a transformers `tokenizer`."""

    spec: ModelSpec
    tokenizer: Any

    def chat_ids(self, request: ChatCompletionRequest, target: JsonTarget | None) -> list[int]:
        """The prompt of `request` (its JSON `target`'s note in the system message), generation prompt included."""
        if request.has_images():
            raise UnsupportedRequestError("this is a text model: image inputs need a multimodal model")
        text = render_chat(self.tokenizer, request.messages, request.tools, self.spec.engine.chat_template,
                           tool_choice_none=request.tool_choice == "none",
                           system_note=target.system_note if target else None,
                           reasoning_effort=request.reasoning_effort)
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
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
