"""`render_chat` on SmolLM2's real tokenizer: its template has no tool support (tools go into the system message,
calls and results become Hermes text), and a Hermes-style template with tool support renders them itself."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from rayrunner.errors import InvalidRequestError
from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.openai.chat_prompt import chat_template_text, render_chat, supports_tools
from rayrunner.openai.tool_calls import ToolFormat, parse_tool_calls, tool_format
from rayrunner.protocol import ChatMessage, Tool

WEATHER = Tool.model_validate({"function": {
    "name": "weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})

HISTORY = [ChatMessage.model_validate(m) for m in [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris "},
                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                                 {"type": "text", "text": "and Rome?"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
]]

# A Qwen/Hermes-style template that renders tools, calls and results itself.
HERMES_TEMPLATE = """\
{%- if tools %}<|system|>TOOLS:{% for tool in tools %} {{ tool.function.name }}={{ tool.function.parameters | tojson }}\
{% endfor %}
{% endif %}
{%- for message in messages %}<|{{ message.role }}|>{{ message.content }}
{%- for call in message.tool_calls or [] %}<tool_call>{"id": "{{ call.id }}", "name": "{{ call.function.name }}", \
"arguments": {{ call.function.arguments | tojson }}}</tool_call>{% endfor %}
{%- if message.role == "tool" %} [{{ message.tool_call_id }} {{ message.name }}]{% endif %}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)


def test_smollm2_template_has_no_tool_support(tokenizer: Any) -> None:
    template = chat_template_text(tokenizer, None, [WEATHER])
    assert not supports_tools(template)
    assert tool_format(template) is ToolFormat.HERMES
    assert supports_tools(HERMES_TEMPLATE)


def test_without_tool_support_tools_and_history_become_text(tokenizer: Any) -> None:
    prompt = render_chat(tokenizer, HISTORY, [WEATHER], None)
    system, user, assistant, results, generation = prompt.split("<|im_start|>")[1:]
    assert system.startswith("system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER.model_dump(mode="json", exclude_none=True)) in system
    assert "<tool_call>" in system and "SmolLM" not in prompt  # the template's default system prompt is replaced
    assert user == "user\nWeather in Paris and Rome?<|im_end|>\n"
    content, calls = parse_tool_calls(assistant.removeprefix("assistant\n").removesuffix("<|im_end|>\n"),
                                      ToolFormat.HERMES)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Paris"}),
                                                                  ("weather", {"city": "Rome"})]
    assert results == ("user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response>"
                       "<|im_end|>\n")
    assert generation == "assistant\n"


def test_without_tool_support_tools_get_their_own_system_message(tokenizer: Any) -> None:
    prompt = render_chat(tokenizer, HISTORY[1:2], [WEATHER], None)
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and prompt.count("<|im_start|>system") == 1
    assert prompt.endswith("<|im_start|>assistant\n")


def test_tool_choice_none_leaves_the_tools_out_but_keeps_the_history(tokenizer: Any) -> None:
    prompt = render_chat(tokenizer, HISTORY, [WEATHER], None, tool_choice_none=True)
    assert "# Tools" not in prompt and "<tools>" not in prompt
    assert prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert prompt.count("<tool_call>") == 2 and prompt.count("<tool_response>") == 2


def test_a_template_with_tool_support_renders_them_itself(tokenizer: Any) -> None:
    prompt = render_chat(tokenizer, HISTORY, [WEATHER], HERMES_TEMPLATE)
    assert prompt == (  # HF templates drop the newline after a block tag
        '<|system|>TOOLS: weather={"type": "object", "properties": {"city": {"type": "string"}}, '
        '"required": ["city"]}'
        "<|system|>Be brief."
        "<|user|>Weather in Paris and Rome?"
        '<|assistant|><tool_call>{"id": "call_1", "name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"id": "call_2", "name": "weather", "arguments": {"city": "Rome"}}</tool_call>'
        "<|tool|>18C [call_1 weather]"
        "<|tool|>24C [call_2 weather]"
        "<|assistant|>"
    )
    assert not render_chat(tokenizer, HISTORY, [WEATHER], HERMES_TEMPLATE, tool_choice_none=True).startswith(
        "<|system|>TOOLS")


def test_arguments_that_are_not_a_json_object_pass_as_their_string(tokenizer: Any) -> None:
    odd = ChatMessage.model_validate({"role": "assistant", "tool_calls": [
        {"id": "c", "function": {"name": "weather", "arguments": "Paris"}}]})
    assert '"arguments": "Paris"' in render_chat(tokenizer, [odd], None, HERMES_TEMPLATE)
    assert '"arguments": "Paris"' in render_chat(tokenizer, [odd], None, None)


def test_template_errors_are_invalid_requests(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        render_chat(tokenizer, HISTORY, None, "{{ raise_exception('roles must alternate') }}")
    assert caught.value.param == "messages" and "roles must alternate" in caught.value.message


def test_named_templates_give_the_tool_use_one_with_tools(tokenizer: Any) -> None:
    named = copy.copy(tokenizer)
    named.chat_template = {"default": tokenizer.chat_template, "tool_use": HERMES_TEMPLATE}
    assert chat_template_text(named, None, [WEATHER]) == HERMES_TEMPLATE
    assert chat_template_text(named, None, None) == tokenizer.chat_template
    named.chat_template = None
    with pytest.raises(InvalidRequestError):
        render_chat(named, HISTORY, None, None)


# The end of Qwen3's template: `enable_thinking` false opens the reply with an empty think block.
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
EFFORT_TEMPLATE = "{{ 'Reasoning: ' + (reasoning_effort | default('unset')) }}"  # as gpt-oss's reads it


@pytest.mark.parametrize(("effort", "thinks"), [(None, True), ("none", False), ("minimal", False), ("low", True),
                                                ("high", True)])
def test_reasoning_effort_reaches_the_templates_thinking_switch(tokenizer: Any, effort: str | None,
                                                                thinks: bool) -> None:
    """Through the text engines' `chat_ids`, from the request as the router passes it on."""
    from rayrunner.engines.chat_tokens import ChatTokens
    from rayrunner.models.spec import build_spec
    from rayrunner.protocol import ChatCompletionRequest

    class Chat(ChatTokens):
        spec = build_spec("qwen3ish", {"type": "plain", "model_id": "m"}, engine={"chat_template": THINKING_TEMPLATE})

    Chat.tokenizer = tokenizer
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}],
                                                    "reasoning_effort": effort})
    prompt = tokenizer.decode(Chat().chat_ids(request, None))
    assert prompt.startswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert prompt.endswith("assistant\n") is thinks and ("<think>" in prompt) is not thinks


def test_reasoning_effort_is_a_template_variable_and_templates_without_a_switch_ignore_it(tokenizer: Any) -> None:
    user = [ChatMessage(role="user", content="Hi")]
    assert render_chat(tokenizer, user, None, EFFORT_TEMPLATE, reasoning_effort="high") == "Reasoning: high"
    assert render_chat(tokenizer, user, None, EFFORT_TEMPLATE) == "Reasoning: unset"
    assert render_chat(tokenizer, user, None, None, reasoning_effort="none") == render_chat(tokenizer, user, None, None)
