"""Recording metrics never fails a request, whatever a finished generation's counts are."""

from __future__ import annotations

from rayrunner.openai.events import GenerationEvent
from rayrunner.runtime import metrics


def test_a_generation_without_completion_tokens_is_recorded() -> None:
    """`echo` with max_tokens 0 scores the prompt and generates nothing; Ray's counters refuse an increment of 0."""
    metrics.generation("m", GenerationEvent(finish_reason="length", prompt_tokens=5, completion_tokens=0))
    metrics.generation("m", GenerationEvent(finish_reason="stop", prompt_tokens=5, completion_tokens=3,
                                            prompt_time_s=0.1, completion_time_s=0.2))
