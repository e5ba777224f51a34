"""A text model's chat request as prompt token ids, and how its replies become tool calls: shared by the engines
that serve text models (rayrunner's `TextEngine`, `VllmEngine`), so both render, constrain and parse alike.

What a client writes is text, never control tokens: a `<|im_end|>` spelt in any message's content, name or tool
call, in a tool's description or schema, or in a completion's prompt is encoded as ordinary text pieces, so only the
chat template's own markers are role markers. The chat path marks them in the client's values and encodes the marked
pieces as text, as transformers' `sanitize_control_tokens` does (the multimodal engine's processor applies that to its
conversations); done here because the vLLM backend's interpreter pins a transformers that predates it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from rayrunner.engines.detokenizer import special_ids
from rayrunner.errors import UnsupportedRequestError
from rayrunner.models.spec import ModelSpec
from rayrunner.openai.chat_prompt import chat_template_text, render_chat
from rayrunner.openai.structured_output import JsonTarget
from rayrunner.openai.tool_calls import markers, tool_format
from rayrunner.openai.tool_replies import ToolReplies
from rayrunner.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, Tool

# Private-use characters around a control token the client spelt (transformers' own markers).
_START, _END = "\U000f0000", "\U000f0001"


def control_tokens(tokenizer: Any, template: str) -> re.Pattern[str]:
    """A pattern of the tokenizer's special tokens and the added tokens `template` writes (not whitespace ones,
    which templates hold as ordinary text), longest first so a token wins over the tokens it contains."""
    tokens = {token.content for token in tokenizer.added_tokens_decoder.values()
              if token.special or (token.content in template and not token.content.isspace())}
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) or "(?!)")


def user_text_marker(pattern: re.Pattern[str]) -> Callable[[Any], Any]:
    """A function that marks the control tokens (`pattern`) spelt in a value from the client, in its strings and
    dict keys alike, so that `encode_marked` writes them as text."""

    def mark(value: Any) -> Any:
        if isinstance(value, str):
            value = value.replace(_START, "").replace(_END, "")  # no forged markers
            return pattern.sub(f"{_START}\\g<0>{_END}", value)
        if isinstance(value, dict):
            return {mark(key): mark(item) for key, item in value.items()}
        if isinstance(value, list):
            return [mark(item) for item in value]
        return value

    return mark


def encode_marked(tokenizer: Any, text: str, pattern: re.Pattern[str]) -> list[int]:
    """The ids of a prompt rendered from values marked by `user_text_marker(pattern)`: each marked control token
    as plain text (its markers dropped), the rest with its control tokens, the template's, as tokens. A lone marker
    (a template's string method split a pair) is dropped but still breaks the text, so the text on either side
    cannot join into a token."""
    marked = re.compile(f"{_START}({pattern.pattern}){_END}|[{_START}{_END}]")
    pieces = marked.split(text)  # [text, marked token or None, text, ...]
    ids = _encode_piece(tokenizer, pieces[0], as_text=False, first=True)
    for i, piece in enumerate(pieces[1:], start=1):
        if piece:
            ids += _encode_piece(tokenizer, piece, as_text=i % 2 == 1, first=False)
    return ids


def _encode_piece(tokenizer: Any, piece: str, as_text: bool, first: bool) -> list[int]:
    """One piece, encoded after a newline that is then removed when it is not the prompt's start (so SentencePiece
    adds no word-start space in mid-prompt)."""
    def encode(value: str) -> list[int]:
        found: list[int] = tokenizer.encode(value, add_special_tokens=False, split_special_tokens=as_text)
        return found

    if not piece:
        return []
    if first:
        return encode(piece)
    newline, ids = encode("\n"), encode("\n" + piece)
    return ids[len(newline):] if ids[: len(newline)] == newline else encode(piece)


class ChatTokens:
    """Mixed into a text engine that has `spec` and a transformers `tokenizer`."""

    spec: ModelSpec
    tokenizer: Any

    def chat_ids(self, request: ChatCompletionRequest, target: JsonTarget | None) -> list[int]:
        """The prompt of `request` (its JSON `target`'s note in the system message), generation prompt included."""
        if request.has_images():
            raise UnsupportedRequestError("this is a text model: image inputs need a multimodal model")
        template = chat_template_text(self.tokenizer, self.spec.engine.chat_template, request.tools)
        pattern = control_tokens(self.tokenizer, template)
        mark = user_text_marker(pattern)
        messages = [ChatMessage.model_validate(mark(message.model_dump())) for message in request.messages]
        tools = [Tool.model_validate(mark(tool.model_dump())) for tool in request.tools] if request.tools else None
        note = mark(target.system_note) if target and target.system_note else None
        text = render_chat(self.tokenizer, messages, tools, self.spec.engine.chat_template,
                           tool_choice_none=request.tool_choice == "none", system_note=note,
                           reasoning_effort=request.reasoning_effort)
        return encode_marked(self.tokenizer, text, pattern)

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
