"""What an engine yields: the events of a generation and an embedding's vectors, from which the replica builds
OpenAI objects (`replies`). Plain data, shared by every engine and the reply shaping."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One token's log probability under the model (before penalties, bias and temperature), with the `top` most
    likely tokens at its position as (text, logprob) pairs, most likely first. None for a prompt's first token."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class GenerationEvent:
    """One step of a generation, of choice `index` (requests with n > 1 interleave their choices' events).

    Rules: an engine yields, per choice, zero or more events with `text` (the new text only, never repeated), then
    exactly one final event with `finish_reason` set (`stop` or `length`) and the token counts and timings filled in.
    The final event may carry text too. `logprobs` holds an entry per token behind the event's text when the request
    asked for them; `prompt_logprobs` (a completions `echo` with logprobs) comes once, on the choice's first event.
    On failure the engine raises instead of yielding.
    """

    text: str = ""
    finish_reason: str | None = None
    index: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those taken from the prefix cache
    completion_tokens: int = 0
    prompt_time_s: float = 0.0
    completion_time_s: float = 0.0


@dataclass
class EmbeddingResult:
    vectors: list[list[float]]
    prompt_tokens: int
