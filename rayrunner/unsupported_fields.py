"""Request fields rayrunner accepts only at their no-op values: the rule (`not_yet`), the OpenAI chat fields and vLLM
extensions to the OpenAI bodies that would change the answer but are not implemented.

A client that sets one of them gets a 400 naming the field rather than an answer that silently ignores what it
asked for. vLLM fields that change nothing here stay accepted and ignored, like any unknown field: `priority`,
`request_id`, `session_id`, `kv_transfer_params`, `vllm_xargs`, `stream_interval` (how many tokens a
streamed chunk holds, not what they say), `length_penalty` (beam search only), `truncation_side` (with
`truncate_prompt_tokens` only), `guided_decoding_backend` and `guided_whitespace_pattern` (with a `guided_*` field
only) and `spaces_between_special_tokens` (vLLM's detokenizer for fast tokenizers ignores it too). So is OpenAI's
`prediction` (Predicted Outputs): a hint that makes an answer faster, never different. Pure pydantic.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, Field
from pydantic_core import PydanticCustomError


def not_yet(*accepted: Any) -> AfterValidator:
    """Marks a field rayrunner does not implement yet: only its no-op values are accepted, any other is a 400 naming
    the field, rather than an answer that silently ignores what the client asked for."""
    shown = " or ".join(json.dumps(value) for value in accepted)

    def check(value: Any) -> Any:
        if value not in accepted:
            raise PydanticCustomError(
                "not_supported_yet", "a value other than {accepted} is not supported yet", {"accepted": shown}
            )
        return value

    return AfterValidator(check)


def not_yet_doc(what: str) -> str:
    return f"{what} Not supported yet: only the default is accepted, any other value is a 400."


def _vllm(what: str) -> Any:
    """The declaration of a vLLM field rayrunner refuses (unset by default)."""
    return Field(None, description=not_yet_doc(f"vLLM extension: {what}"))


Refused = Annotated[Any, not_yet(None, False)]  # vLLM flags that are off by default
RefusedUnlessSet = Annotated[Any, not_yet(None)]  # vLLM values that do something whenever they are given
RefusedUnlessEmpty = Annotated[Any, not_yet(None, [], {})]  # vLLM lists and mappings


class VllmSamplingUnsupported(BaseModel):
    """vLLM's sampling extensions, of chat and text completions, that rayrunner does not implement."""

    use_beam_search: Refused = _vllm("beam search instead of sampling.")
    prompt_logprobs: RefusedUnlessSet = _vllm("the prompt tokens' logprobs (completions: use `echo` with "
                                              "`logprobs`).")
    logprob_token_ids: RefusedUnlessEmpty = _vllm("logprobs of these token ids at each position.")
    allowed_token_ids: RefusedUnlessSet = _vllm("sample only among these token ids.")
    bad_words: RefusedUnlessEmpty = _vllm("words never generated.")
    truncate_prompt_tokens: RefusedUnlessSet = _vllm("keep only the prompt's last k tokens.")
    watermarking: Refused = _vllm("watermark the output.")
    thinking_token_budget: Annotated[Any, not_yet(None, -1)] = _vllm("cap a reasoning model's thinking.")
    repetition_detection: RefusedUnlessSet = _vllm("end the reply on repeated n-grams.")
    logits_processors: RefusedUnlessEmpty = _vllm("custom logits processors.")
    guided_json: RefusedUnlessSet = _vllm("output valid for a JSON Schema (use `response_format`).")
    guided_regex: RefusedUnlessSet = _vllm("output matching a regular expression.")
    guided_choice: RefusedUnlessSet = _vllm("output that is one of these strings.")
    guided_grammar: RefusedUnlessSet = _vllm("output in a context-free grammar.")
    structural_tag: RefusedUnlessSet = _vllm("output with tagged structured parts.")
    structured_outputs: RefusedUnlessSet = _vllm("structured output options (use `response_format`).")
    return_tokens_as_token_ids: Refused = _vllm("logprob tokens written as `token_id:N`.")
    return_token_ids: Refused = _vllm("the token ids of the prompt and the output.")


class OpenAIChatUnsupported(BaseModel):
    """OpenAI chat fields that ask for what rayrunner does not do: audio, web search."""

    modalities: Annotated[Any, not_yet(None, ["text"])] = Field(
        None, description=not_yet_doc('The output\'s modalities: only `["text"]`.'))
    audio: RefusedUnlessSet = Field(None, description=not_yet_doc("Audio output: its voice and format."))
    web_search_options: RefusedUnlessSet = Field(None, description=not_yet_doc("Search the web before answering."))


class VllmChatUnsupported(VllmSamplingUnsupported):
    """vLLM's chat extensions (how the prompt is rendered) that rayrunner does not implement."""

    echo: Refused = _vllm("prepend the last message when it has the reply's role.")
    add_generation_prompt: Annotated[Any, not_yet(None, True)] = _vllm("end the prompt with the assistant's "
                                                                       "header (default true).")
    continue_final_message: Refused = _vllm("continue the last message instead of starting a new one.")
    add_special_tokens: Refused = _vllm("add BOS and the like on top of the chat template's.")
    documents: RefusedUnlessEmpty = _vllm("documents for a RAG chat template.")
    chat_template: RefusedUnlessSet = _vllm("a Jinja chat template for this request.")
    chat_template_kwargs: RefusedUnlessEmpty = _vllm("variables for the chat template.")
    mm_processor_kwargs: RefusedUnlessEmpty = _vllm("arguments for the multimodal processor.")
    media_io_kwargs: RefusedUnlessEmpty = _vllm("arguments for loading media.")


class VllmCompletionUnsupported(VllmSamplingUnsupported):
    """vLLM's text-completion extensions that rayrunner does not implement."""

    response_format: Annotated[Any, not_yet(None, {"type": "text"})] = _vllm("structured output of a text "
                                                                             "completion (chat has it).")
    prompt_embeds: RefusedUnlessSet = _vllm("prompt embeddings instead of text.")
