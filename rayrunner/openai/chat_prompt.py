"""Chat prompts with tools: rendered through the chat template's own tool support when it has some; otherwise the
tools are described in the system message, and past calls and their results are written as Hermes `<tool_call>` /
`<tool_response>` text, which any template can render."""

from __future__ import annotations

import json
import re
from typing import Any

from transformers import PreTrainedTokenizerBase

from rayrunner.errors import InvalidRequestError
from rayrunner.protocol import ChatMessage, Tool, ToolCall

Message = dict[str, Any]


def chat_template_text(tokenizer: PreTrainedTokenizerBase, chat_template: str | None,
                       tools: list[Tool] | None) -> str:
    """The template that renders a chat: `chat_template` (the spec's override), else the tokenizer's (its
    `tool_use` template, if it has named ones, when tools are given). Pass it to `tool_calls.tool_format`."""
    try:
        return tokenizer.get_chat_template(chat_template, _tool_dicts(tools) or None)
    except ValueError as exc:
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None


def supports_tools(template: str) -> bool:
    """Whether a template renders tools itself (it reads the `tools` variable)."""
    return re.search(r"\btools\b", template) is not None


def reasoning_switches(template: str | None, effort: str | None) -> dict[str, Any]:
    """The chat-template variables for a request's `reasoning_effort`: `reasoning_effort` itself, as vLLM passes it
    (gpt-oss's template reads it), and `enable_thinking` when the template has Qwen3's switch (off for `none` and
    `minimal`, on for the rest); none without an effort, so each template's own default holds."""
    if effort is None:
        return {}
    switches: dict[str, Any] = {"reasoning_effort": effort}
    if template is not None and re.search(r"\benable_thinking\b", template):
        switches["enable_thinking"] = effort not in ("none", "minimal")
    return switches


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[ChatMessage], tools: list[Tool] | None,
                chat_template: str | None, tool_choice_none: bool = False, system_note: str | None = None,
                reasoning_effort: str | None = None) -> str:
    """The prompt text for a chat, generation prompt included. With `tool_choice_none` the tools are not offered
    (calls and results already in the history are still rendered). `system_note` is added to the system message
    (e.g. the schema a JSON answer must follow). `reasoning_effort` reaches the template's switches
    (`reasoning_switches`). Only the text of content parts is used."""
    template = chat_template_text(tokenizer, chat_template, tools)
    switches = reasoning_switches(template, reasoning_effort)
    offered = None if tool_choice_none else tools
    native = supports_tools(template)
    conversation = _template_messages(messages) if native else _text_messages(messages, offered)
    if system_note:
        _add_to_system(conversation, system_note)
    tool_dicts: list[Any] | None = (_tool_dicts(offered) or None) if native else None
    try:
        return _apply(tokenizer, conversation, tool_dicts, template, switches)
    except Exception as exc:
        merged = _system_in_first_user_turn(conversation)
        if merged is None:
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None
        try:  # templates that refuse a system turn (Gemma, Gemma 2): its text opens the first user turn
            return _apply(tokenizer, merged, tool_dicts, template, switches)
        except Exception:
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from None


def _apply(tokenizer: PreTrainedTokenizerBase, conversation: list[Message], tools: list[Any] | None,
           template: str, switches: dict[str, Any]) -> str:
    return str(tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template,
                                             add_generation_prompt=True, tokenize=False, **switches))


def _system_in_first_user_turn(conversation: list[Message]) -> list[Message] | None:
    """The conversation with its system message's text put at the start of the first user message (None: it has no
    system message followed by a user one)."""
    if len(conversation) < 2 or conversation[0]["role"] != "system" or conversation[1]["role"] != "user":
        return None
    system, user = conversation[0]["content"], conversation[1]["content"]
    if not isinstance(system, str):
        return None
    content: Any = f"{system}\n\n{user}" if isinstance(user, str) else [{"type": "text", "text": system}, *user]
    return [{**conversation[1], "content": content}, *conversation[2:]]


def _tool_dicts(tools: list[Tool] | None) -> list[dict[str, Any]]:
    return [tool.model_dump(mode="json", exclude_none=True) for tool in tools or []]


def _role(message: ChatMessage) -> str:
    return "system" if message.role == "developer" else message.role


def _arguments(call: ToolCall) -> Any:
    """A call's arguments as the object templates expect; left as the string when it is not a JSON object."""
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments


def _call_names(messages: list[ChatMessage]) -> dict[str, str]:
    """Function name by call id, from the assistant messages' calls (OpenAI tool messages carry only the id)."""
    return {call.id: call.function.name for message in messages for call in message.tool_calls or []}


# ---------------------------------------------------------------- templates with tool support


def _template_messages(messages: list[ChatMessage]) -> list[Message]:
    names = _call_names(messages)
    return [_template_message(message, names) for message in messages]


def _template_message(message: ChatMessage, names: dict[str, str]) -> Message:
    """The message in the shape HF chat templates read: calls as `{"type", "function": {"name", "arguments":
    {...}}}`, tool results with their `tool_call_id` and function `name`."""
    out: Message = {"role": _role(message), "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [{"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": _arguments(call)}}
                             for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    name = message.name or (names.get(message.tool_call_id or "") if message.role == "tool" else None)
    if name:
        out["name"] = name
    return out


# ---------------------------------------------------------------- templates without tool support


def _text_messages(messages: list[ChatMessage], tools: list[Tool] | None) -> list[Message]:
    """Plain text messages: calls as `<tool_call>` blocks in the assistant's text, each run of tool results as one
    user message of `<tool_response>` blocks (templates that insist on alternating roles accept that), and the
    tools described in the first system message."""
    out: list[Message] = []
    for index, message in enumerate(messages):
        if message.role != "tool":
            out.append({"role": _role(message), "content": _with_calls(message)})
        elif index and messages[index - 1].role == "tool":
            out[-1]["content"] += "\n" + _tool_response(message)
        else:
            out.append({"role": "user", "content": _tool_response(message)})
    if tools:
        _describe_tools(out, tools)
    return out


def _with_calls(message: ChatMessage) -> str:
    blocks = [json.dumps({"name": call.function.name, "arguments": _arguments(call)}, ensure_ascii=False)
              for call in message.tool_calls or []]
    parts = [message.text()] if message.text() else []
    return "\n".join(parts + [f"<tool_call>\n{block}\n</tool_call>" for block in blocks])


def _tool_response(message: ChatMessage) -> str:
    return f"<tool_response>\n{message.text()}\n</tool_response>"


def _describe_tools(conversation: list[Message], tools: list[Tool]) -> None:
    """Adds the tools and how to call them to the first system message, or as a new first system message."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in _tool_dicts(tools))
    prompt = (
        "# Tools\n\nYou can call functions to help answer. Each function is described by a JSON Schema of its "
        f"arguments:\n<tools>\n{listing}\n</tools>\n\nTo call functions, reply with one block per call, each "
        "holding a JSON object with the function's name and its arguments:\n<tool_call>\n"
        '{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>'
    )
    _add_to_system(conversation, prompt)


def _add_to_system(conversation: list[Message], text: str) -> None:
    """Appends `text` to the first message when it is the system message, else puts it first as one."""
    if conversation and conversation[0]["role"] == "system":
        first = conversation[0]["content"]
        conversation[0]["content"] = f"{first}\n\n{text}" if first else text
    else:
        conversation.insert(0, {"role": "system", "content": text})
