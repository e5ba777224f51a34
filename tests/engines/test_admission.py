"""The scheduler's admission policy on plain sequences (no model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rayrunner.engines.transformers.step.admission import Admission


@dataclass(eq=False)  # two sequences alike are still two (the planner's tests compare by identity)
class Seq:
    """A waiting sequence as admission and the planner see it: `length` prompt tokens, no model."""

    length: int
    forks: int = 0
    adapter: str | None = None
    extra_inputs: dict[str, Any] = field(default_factory=dict)
    scores_prompt: bool = False
    prefilled: int = 0

    @property
    def prefill_ids(self) -> list[int]:
        return [0] * self.length

    @property
    def slots(self) -> int:
        return 1 + self.forks


def test_whole_prompts_start_together_within_the_chunk_budget() -> None:
    admission = Admission(chunk_tokens=100)
    waiting = [Seq(20), Seq(30), Seq(10), Seq(25)]
    assert admission.group(waiting, [], free_slots=8) == 3  # 4 x 30 > 100: the fourth waits for the next step


def test_free_slots_bound_the_group_and_forks_count() -> None:
    admission = Admission(chunk_tokens=1000)
    assert admission.group([Seq(5), Seq(5), Seq(5)], [], free_slots=2) == 2
    assert admission.group([Seq(5, forks=2), Seq(5)], [], free_slots=3) == 1
    assert admission.group([Seq(5, forks=3)], [], free_slots=3) == 0


def test_a_prompt_that_needs_its_own_pass_goes_alone() -> None:
    admission = Admission(chunk_tokens=100)
    long, image, scored = Seq(150), Seq(10, extra_inputs={"pixel_values": 1}), Seq(10, scores_prompt=True)
    assert admission.chunked(long) and not admission.chunked(Seq(100))
    for alone in (long, image, scored):
        assert admission.group([alone, Seq(5)], [], free_slots=8) == 1
        assert admission.group([Seq(5), alone], [], free_slots=8) == 1


def test_an_adapter_waits_while_max_adapters_others_are_in_use() -> None:
    admission = Admission(chunk_tokens=1000, max_adapters=2)
    running = [Seq(5, adapter="a"), Seq(5, adapter="b")]
    assert admission.group([Seq(5, adapter="c")], running, free_slots=8) == 0
    assert admission.group([Seq(5, adapter="a"), Seq(5), Seq(5, adapter="c")], running, free_slots=8) == 2
    assert admission.group([Seq(5, adapter="c"), Seq(5, adapter="d")], [], free_slots=8) == 2
    assert admission.group([Seq(5, adapter="c"), Seq(5, adapter="d"), Seq(5, adapter="e")], [], free_slots=8) == 2
