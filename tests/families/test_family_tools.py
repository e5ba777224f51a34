"""Which tool-call format rayrunner reads for each family in `tiny_families`, and whether it reads the calls the
family's instruct models write.

rayrunner picks the format from the chat template (`tool_calls.tool_format`): Mistral's `[TOOL_CALLS]`, Hermes
`<tool_call>` blocks, Llama 3.x JSON, Cohere's action blocks, Granite's `<|tool_call|>` lists, gpt-oss's harmony
messages, OLMo 3's `<function_calls>`; a template without tool support gets the tools described in a system message
that asks for Hermes blocks (`chat_prompt`). The tiny models have no chat template, so each family's case is its
template's tool markers (a fragment written here, not the template) and the call its instruct models write, as their
model cards show. A format rayrunner did not parse would leave the call in the reply's content (`parsed=False`, a
"no" in docs/architectures.md), so the table changes when the parser does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from transformers import AutoTokenizer

from rayrunner.errors import InvalidRequestError
from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.openai.chat_prompt import render_chat, supports_tools
from rayrunner.openai.tool_calls import ToolFormat, markers, parse_tool_calls, tool_format
from rayrunner.protocol import ChatMessage, Tool
from tests.families.tiny_families import FAMILIES

pytestmark = pytest.mark.usefixtures("one_thread")

CITY = {"city": "Paris"}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL = Tool.model_validate({"function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})

# Templates' tool markers (fragments: enough for `tool_format` and `supports_tools`)
LLAMA3 = ('{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument name '
          'and its value}.{{ tools | tojson }}{%- endif %}{{- "<|python_tag|>" }}')
MISTRAL = '{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}{{ "[TOOL_CALLS]" }}'
HERMES = ("{%- if tools %}<tools>{{ tools | tojson }}</tools> For each function call, return a json object within "
          "<tool_call></tool_call> XML tags{%- endif %}")
HARMONY = ("{%- if tools %}namespace functions { {{ tools | tojson }} }{%- endif %}"
           "<|start|>assistant<|channel|>commentary to=functions.{{ name }} <|constrain|>json<|message|>")
COHERE = ('{% for tool in tools %}{"name": "{{ tool.function.name }}", "parameters": '
          '{{ tool.function.parameters|tojson }}}{% endfor %}'
          '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "{{ name }}", "parameters": {}}]<|END_ACTION|>')
GRANITE = ("{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{{ tools | tojson }}. When a tool is "
           "required, respond only with <|tool_call|> followed by a JSON list of tools used.{%- endif %}")
OLMO3 = ("{%- if tools %}<functions>{{ tools | tojson }}</functions>{%- endif %}"
         "{{- '<function_calls>' + name + '(' + arguments + ')' -}}{{- '</function_calls>' -}}")
# Mistral's newer templates (tokenizer v11 on: Ministral 3, Mistral Small 3.2, Magistral, Devstral)
MISTRAL_NAMED = ('{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}'
                 '{{ "[TOOL_CALLS]" + tool.name + "[ARGS]" + tool.arguments | tojson }}')
PLAIN = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
         "{% endfor %}")
# Gemma's and Gemma 2's own templates refuse a system turn
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             + PLAIN)


@dataclass(frozen=True)
class Case:
    template: str  # the template's tool markers, or a template without tool support
    output: str  # a call as the family's instruct models write it (special tokens kept)
    parsed: bool  # rayrunner reads it as the call get_weather(city=Paris)


CASES: dict[str, Case] = {
    "Llama": Case(LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}', True),  # Llama 3.1-3.3
    "Mistral (sliding window)": Case(MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                                     True),  # Mistral 7B v0.3
    "Ministral (sliding window)": Case(
        MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]', True),
    "Qwen2": Case(HERMES, HERMES_CALL, True),  # Qwen2.5
    "Qwen3": Case(HERMES, "<think>\n\n</think>\n\n" + HERMES_CALL, True),
    "Qwen3-MoE": Case(HERMES, HERMES_CALL, True),
    "Gemma": Case(NO_SYSTEM, HERMES_CALL, True),
    "Gemma 2 (sliding + full)": Case(NO_SYSTEM, HERMES_CALL, True),
    "Gemma 3 (sliding + full)": Case(PLAIN, HERMES_CALL, True),  # folds a system turn into the first user turn
    "Phi-3 (sliding window)": Case(PLAIN, HERMES_CALL, True),
    "gpt-oss (sliding + full, MoE)": Case(
        HARMONY, '<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>'
                 'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>', True),
    "Cohere2 (sliding + full)": Case(
        COHERE, '<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", "parameters": '
                '{"city": "Paris"}}\n]<|END_ACTION|>', True),  # Command R7B
    "Granite": Case(GRANITE, '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', True),
    "SmolLM3": Case(HERMES, HERMES_CALL, True),
    "OLMo 2": Case(PLAIN, HERMES_CALL, True),
    "OLMo 3 (sliding + full)": Case(OLMO3, '<function_calls>get_weather(city="Paris")</function_calls>', True),
    "StarCoder2 (sliding window)": Case(PLAIN, HERMES_CALL, True),
    "EXAONE 4 (sliding + full)": Case(HERMES, HERMES_CALL, True),
    "StableLM": Case(PLAIN, HERMES_CALL, True),
}
# Families whose templates refuse the system message rayrunner describes the tools in (it opens the user turn)
REFUSE_SYSTEM = {family for family, case in CASES.items() if case.template == NO_SYSTEM}
FORMATS = {LLAMA3: ToolFormat.LLAMA, MISTRAL: ToolFormat.MISTRAL, COHERE: ToolFormat.COHERE,
           GRANITE: ToolFormat.GRANITE, HARMONY: ToolFormat.HARMONY, OLMO3: ToolFormat.OLMO}


def test_every_family_has_a_case() -> None:
    assert set(CASES) == set(FAMILIES)


@pytest.fixture(scope="module")
def smol() -> Any:
    return AutoTokenizer.from_pretrained(resolve(SMOLLM2).path)


@pytest.mark.parametrize("family", list(CASES))
def test_the_familys_tool_calls_are_read_in_the_format_its_template_picks(family: str) -> None:
    case = CASES[family]
    fmt = tool_format(case.template)
    assert fmt is FORMATS.get(case.template, ToolFormat.HERMES)
    for text in {case.output, _without_special_tokens(case.output, markers(fmt))}:  # as streamed
        content, calls = parse_tool_calls(text, fmt)
        if case.parsed:
            assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", CITY)]
            assert content is None or "get_weather" not in content
        else:
            assert calls == [] and content is not None and "get_weather" in content


def _without_special_tokens(text: str, kept: tuple[str, ...]) -> str:
    """`text` as a detokenizer that drops special tokens writes it (markers in `<|...|>` form dropped, the `kept` ones
    that the format's parser reads excepted: the engine keeps those)."""
    for token in ("<|START_ACTION|>", "<|END_ACTION|>", "<|tool_call|>", "<|start|>", "<|channel|>",
                  "<|constrain|>", "<|message|>", "<|end|>", "<|call|>"):
        text = text if token in kept else text.replace(token, "")
    return text


@pytest.mark.parametrize("family", sorted(f for f, c in CASES.items() if not supports_tools(c.template)
                                          and f not in REFUSE_SYSTEM))
def test_a_template_without_tools_gets_rayrunners_hermes_prompt(family: str, smol: Any) -> None:
    prompt = render_chat(smol, [ChatMessage(role="user", content="Weather in Paris?")], [TOOL], CASES[family].template)
    assert "<tool_call>" in prompt and '"get_weather"' in prompt and prompt.index("system") < prompt.index("Weather")


@pytest.mark.parametrize("family", sorted(REFUSE_SYSTEM))
def test_a_template_that_refuses_a_system_turn_still_gets_the_tools(family: str, smol: Any) -> None:
    """Gemma's and Gemma 2's templates refuse a system turn: the tools' description (and a user's own system message)
    opens the first user turn instead."""
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="Weather in Paris?")]
    prompt = render_chat(smol, messages, [TOOL], CASES[family].template)
    assert "<tool_call>" in prompt and '"get_weather"' in prompt
    assert prompt.index("Be brief.") < prompt.index("get_weather") < prompt.index("Weather in Paris?")
    with pytest.raises(InvalidRequestError):  # no user turn to open: still the template's 400
        render_chat(smol, [ChatMessage(role="system", content="Be brief.")], None, CASES[family].template)


def test_mistrals_name_args_form_is_read() -> None:
    """Mistral's newer tokenizers write a call as `[TOOL_CALLS]name[ARGS]{...}` (no JSON list), one marker a call;
    their templates pick the Mistral format too, which reads both forms (`[ARGS]` a special token kept for it)."""
    fmt = tool_format(MISTRAL_NAMED)
    assert fmt is ToolFormat.MISTRAL and "[ARGS]" in markers(fmt)
    content, calls = parse_tool_calls('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]'
                                      '{"city": "Lyon"}', fmt)
    assert content is None
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", CITY),
                                                                          ("get_weather", {"city": "Lyon"})]
