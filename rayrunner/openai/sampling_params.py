"""A request's sampling settings, resolved from its OpenAI fields (`sampling_params`), as every engine takes them.

Torch-free: the replica's server builds them before handing a request to its engine; the step loop applies them
(`rayrunner.engines.transformers.step.sampling`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rayrunner.errors import InvalidRequestError
from rayrunner.models.spec import EngineSettings
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

if TYPE_CHECKING:
    import torch

# A row's logits processor: (prompt ids, generated ids, logits of shape [vocab]) -> logits.
LogitsProcessor = Callable[[list[int], list[int], "torch.Tensor"], "torch.Tensor"]


@dataclass
class SamplingParams:
    """Per-request generation settings, already resolved (defaults applied, limits checked)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: off; k: each chosen token's logprob and the k most likely alternatives
    prompt_logprobs: bool = False  # completions `echo` with logprobs: the prompt's tokens' logprobs too
    n: int = 1  # choices from one prompt (the scheduler prefills once and forks the cache)
    min_tokens: int = 0  # until this many are out, the ids that end a reply are masked (stop strings: `Detokenizer`)
    ignore_eos: bool = False  # the model's EOS ids do not end the reply (the scheduler gives the sequence none)
    include_stop_str_in_output: bool = False  # the stop string or stop token that ended the reply stays in its text
    skip_special_tokens: bool = True
    cache_salt: str | None = None  # prefix-cache blocks are shared only with requests of the same salt
    # Makes a fresh processor per sequence, given its reply's token budget (`max_tokens`), that masks the tokens a
    # grammar forbids (structured output, tool calls).
    constraint: Callable[[int | None], LogitsProcessor] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def sampling_params(request: SamplingFields, settings: EngineSettings) -> SamplingParams:
    """Resolved settings: unset fields take their neutral value; unset or zero temperature means greedy."""
    max_tokens = request.max_tokens if request.max_tokens is not None else settings.default_max_tokens
    if request.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens is {request.min_tokens}, more than max_tokens ({max_tokens})",
                                  param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature or 0.0,
        top_p=request.top_p if request.top_p is not None else 1.0,
        top_k=request.top_k or 0,
        min_p=request.min_p or 0.0,
        stop=request.stop_list(),
        stop_token_ids=list(request.stop_token_ids or []),
        seed=request.seed,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=request.repetition_penalty or 1.0,
        logit_bias=dict(request.logit_bias or {}),
        n=request.n or 1,
        min_tokens=request.min_tokens,
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
        cache_salt=request.cache_salt,
        **_logprob_settings(request),
    )


def _logprob_settings(request: SamplingFields) -> dict[str, Any]:
    """Chat: `logprobs` + `top_logprobs`; completions: `logprobs` (the alternatives' count) and `echo`."""
    if isinstance(request, ChatCompletionRequest):
        return {"logprobs": (request.top_logprobs or 0) if request.logprobs else None}
    if isinstance(request, CompletionRequest):
        return {"logprobs": request.logprobs, "prompt_logprobs": bool(request.echo) and request.logprobs is not None}
    return {}
