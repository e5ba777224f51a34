"""Request bodies as the router checks them: fields not implemented, fields checked against each other, ignored
fields, and the sampling fields."""

from __future__ import annotations

from typing import Any

import pytest

from rayrunner.errors import InvalidRequestError
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from rayrunner.router.app import validated

MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return validated(ChatCompletionRequest, {"messages": MESSAGES, **fields})


def completion(**fields: Any) -> dict[str, Any]:
    return validated(CompletionRequest, {"prompt": "hi", **fields})


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("field", "value"), [("functions", [TOOL["function"]]), ("function_call", "auto")])
def test_chat_fields_not_implemented_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**{field: value})
    assert caught.value.param == field and caught.value.status == 400
    assert caught.value.message.startswith(f"{field}: ") and "is not supported yet" in caught.value.message


@pytest.mark.parametrize(("field", "value"), [("best_of", 3), ("suffix", " end")])
def test_completion_fields_not_implemented_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        completion(**{field: value})
    assert caught.value.param == field and "is not supported yet" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"top_logprobs": 3}, "top_logprobs needs logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"n": 17}, "n"),
        ({"tool_choice": "required"}, "tool_choice `required` needs tools"),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "names `g`"),
        ({"tools": [TOOL, TOOL]}, "same name"),
        ({"response_format": {"type": "json_schema"}}, "needs `json_schema`"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_chat_fields_checked_against_each_other(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidRequestError, match=says) as caught:
        chat(**fields)
    assert not caught.value.message.startswith(("the request body", "Value error"))


def test_completion_max_tokens_zero_only_with_echo() -> None:
    with pytest.raises(InvalidRequestError, match="only meaningful with echo"):
        completion(max_tokens=0)
    assert completion(max_tokens=0, echo=True, logprobs=0)["max_tokens"] == 0


def test_default_values_of_those_fields_are_accepted() -> None:
    chat(n=1, logprobs=False, top_logprobs=None, response_format={"type": "text"}, tools=[], tool_choice="none",
         parallel_tool_calls=True, functions=None, function_call="none")
    chat(n=None, logprobs=None, response_format=None, tools=None, tool_choice=None)
    completion(n=1, echo=False, logprobs=None, best_of=1, suffix=None)


def test_fields_that_do_not_change_the_output_are_ignored() -> None:
    body = chat(user="u-1", metadata={"k": "v"}, store=False, service_tier="auto", some_future_field=[1])
    assert not {"metadata", "store", "service_tier", "some_future_field"} & set(body)
    assert body["user"] == "u-1"  # kept: `routing: prefix` keeps a user on one replica


def test_sampling_fields_are_declared_and_checked() -> None:
    body = chat(min_p=0.05, presence_penalty=-1.5, frequency_penalty=2, repetition_penalty=1.1,
                logit_bias={"50256": -100, "7": 2.5}, stop_token_ids=[2, 7], seed=3, top_k=40)
    assert body["logit_bias"] == {50256: -100.0, 7: 2.5}
    assert body["stop_token_ids"] == [2, 7] and body["min_p"] == 0.05 and body["repetition_penalty"] == 1.1
    assert ChatCompletionRequest.model_validate(body).logit_bias == {50256: -100.0, 7: 2.5}  # as the model re-reads it
    assert completion(presence_penalty=0.5)["presence_penalty"] == 0.5
    unset = chat()
    assert all(unset[f] is None for f in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                          "logit_bias", "stop_token_ids"))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("logit_bias", {"not-a-token": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"5": 101}),
        ("stop_token_ids", ["eos"]),
    ],
)
def test_bad_sampling_values_name_their_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**{field: value})
    assert caught.value.param == field


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("use_beam_search", True), ("prompt_logprobs", 1), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]),
        ("truncate_prompt_tokens", 10), ("guided_json", {"type": "object"}), ("guided_regex", "a+"),
        ("guided_choice", ["a", "b"]), ("guided_grammar", "root ::= 'a'"), ("structured_outputs", {"regex": "a"}),
        ("logits_processors", ["x"]), ("return_token_ids", True), ("thinking_token_budget", 10),
    ],
)
def test_vllm_fields_not_implemented_are_refused_on_both_endpoints(field: str, value: Any) -> None:
    for build in (chat, completion):
        with pytest.raises(InvalidRequestError) as caught:
            build(**{field: value})
        assert caught.value.param == field and "is not supported yet" in caught.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [("echo", True), ("add_generation_prompt", False), ("continue_final_message", True), ("chat_template", "{{ x }}"),
     ("chat_template_kwargs", {"enable_thinking": False}), ("add_special_tokens", True), ("documents", [{"a": "b"}])],
)
def test_vllm_chat_fields_not_implemented_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**{field: value})
    assert caught.value.param == field


def test_vllm_fields_at_their_defaults_or_without_effect_are_accepted() -> None:
    chat(use_beam_search=False, bad_words=[], add_generation_prompt=True, echo=False, chat_template_kwargs={},
         length_penalty=1.3, spaces_between_special_tokens=False, priority=3, request_id="r", stream_interval=4)
    completion(response_format={"type": "text"}, add_special_tokens=False, prompt_logprobs=None)
    with pytest.raises(InvalidRequestError) as caught:
        completion(response_format={"type": "json_object"})
    assert caught.value.param == "response_format"


def test_vllm_length_and_text_settings_are_declared() -> None:
    body = chat(ignore_eos=True, min_tokens=5, include_stop_str_in_output=True, skip_special_tokens=False)
    assert (body["ignore_eos"], body["min_tokens"], body["include_stop_str_in_output"],
            body["skip_special_tokens"]) == (True, 5, True, False)
    unset = completion()
    assert (unset["ignore_eos"], unset["min_tokens"], unset["skip_special_tokens"]) == (False, 0, True)
    with pytest.raises(InvalidRequestError) as caught:
        chat(min_tokens=-1)
    assert caught.value.param == "min_tokens"


@pytest.mark.parametrize(("field", "value"), [("modalities", ["text", "audio"]), ("modalities", ["audio"]),
                                              ("audio", {"voice": "alloy", "format": "wav"}),
                                              ("web_search_options", {}),
                                              ("web_search_options", {"search_context_size": "low"})])
def test_openai_chat_fields_not_implemented_are_refused(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        chat(**{field: value})
    assert caught.value.param == field and caught.value.status == 400
    assert "is not supported yet" in caught.value.message


def test_openai_chat_fields_at_their_defaults_or_only_faster_are_accepted() -> None:
    body = chat(modalities=["text"], audio=None, web_search_options=None,
                prediction={"type": "content", "content": "print('hi')"})
    assert body["modalities"] == ["text"] and "prediction" not in body  # a latency hint: the answer is the same


def test_reasoning_effort_is_kept_for_the_chat_template() -> None:
    assert chat(reasoning_effort="minimal")["reasoning_effort"] == "minimal"
    assert chat()["reasoning_effort"] is None
    with pytest.raises(InvalidRequestError) as caught:
        chat(reasoning_effort="extreme")
    assert caught.value.param == "reasoning_effort"
