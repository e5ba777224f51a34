"""The logits stage on its own: each row of one batch keeps its own settings."""

from __future__ import annotations

import pytest
import torch

from rayrunner.engines.transformers.step.sampling import (
    SamplingRow,
    greedy_tokens,
    logits_processors,
    logprobs_of,
    new_generator,
    sample,
)
from rayrunner.openai.sampling_params import SamplingParams

VOCAB = 50


def _row(prompt: list[int] | None = None, output: list[int] | None = None, **settings: object) -> SamplingRow:
    params = SamplingParams(max_tokens=8, **settings)  # type: ignore[arg-type]
    return SamplingRow(params, prompt or [], output or [], logits_processors(params),
                       new_generator(params, torch.device("cpu")))


def _logits(rows: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(rows, VOCAB)


def test_greedy_rows_take_the_argmax_beside_sampled_rows() -> None:
    logits = _logits(3)
    rows = [_row(), _row(temperature=1.0, seed=1), _row()]
    tokens = sample(logits.clone(), rows)
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_greedy_tokens_are_argmax_over_a_large_vocabulary() -> None:
    """Found block by block, yet the same token as argmax: the first of equal maxima (across and within blocks),
    NaN counting as the largest, a row of -inf."""
    torch.manual_seed(0)
    logits = torch.randn(6, 49152)
    logits[1, 300] = logits[1, 40000] = 50.0  # a tie across blocks: the first wins
    logits[2, 129] = logits[2, 130] = 50.0  # a tie within a block
    logits[3, 7000] = float("nan")
    logits[4] = float("-inf")
    logits[5, 49151] = 50.0  # the last logit
    assert greedy_tokens(logits).tolist() == logits.argmax(dim=-1).tolist() == [
        int(logits[0].argmax()), 300, 129, 7000, 0, 49151]
    odd = torch.randn(2, 1000)  # a vocabulary not in whole blocks: plain argmax
    assert greedy_tokens(odd).tolist() == odd.argmax(dim=-1).tolist()


def test_top_k_one_is_greedy_and_min_p_one_is_greedy() -> None:
    logits = _logits(2)
    for settings in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-6}):
        rows = [_row(temperature=1.5, seed=s, **settings) for s in range(2)]  # type: ignore[arg-type]
        assert sample(logits.clone(), rows) == logits.argmax(dim=-1).tolist()


def test_top_k_keeps_draws_inside_the_top_k() -> None:
    logits = _logits(1)
    allowed = set(logits[0].topk(3).indices.tolist())
    draws = {sample(logits.clone(), [_row(temperature=2.0, top_k=3, seed=s)])[0] for s in range(40)}
    assert draws <= allowed and len(draws) > 1


def test_a_seeded_row_draws_the_same_whatever_its_companions() -> None:
    logits = _logits(4)
    seeded = logits[2].clone()

    def steps(rows: list[SamplingRow], index: int, batch: torch.Tensor) -> list[int]:
        return [sample(batch.clone(), rows)[index] for _ in range(6)]  # the row's generator runs on across steps

    alone = steps([_row(temperature=1.0, seed=7)], 0, seeded.unsqueeze(0))
    batch = torch.stack([logits[0], seeded, logits[1], logits[3]])
    companions = [_row(temperature=0.7, seed=1), _row(temperature=1.0, seed=7), _row(temperature=1.2), _row()]
    assert steps(companions, 1, batch) == alone
    assert len(set(alone)) > 1  # it does sample


def test_logit_bias_bans_and_forces_tokens() -> None:
    logits = _logits(2)
    best = int(logits[0].argmax())
    banned, forced = sample(logits.clone(), [_row(logit_bias={best: -100.0}), _row(logit_bias={7: 100.0})])
    assert banned != best and forced == 7


def test_penalties_push_away_from_seen_tokens() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 1.0
    logits[0, 4] = 0.9
    assert sample(logits.clone(), [_row(output=[3], presence_penalty=0.5)]) == [4]
    assert sample(logits.clone(), [_row(output=[3, 3], frequency_penalty=0.1)]) == [4]
    assert sample(logits.clone(), [_row(prompt=[3], repetition_penalty=1.5)]) == [4]
    assert sample(logits.clone(), [_row(prompt=[3], presence_penalty=0.5)]) == [3]  # OpenAI's: output only


@pytest.mark.slow
def test_draws_follow_the_distribution_past_the_candidates() -> None:
    """A near-flat distribution over more tokens than the candidate window (the 512 most likely, ids 0-511 here):
    the tail past the window is drawn exactly as often as its mass says, and a wide nucleus is not cut at the
    window."""
    vocab, draws = 2048, 4000
    logits = -0.001 * torch.arange(vocab, dtype=torch.float32).unsqueeze(0)
    tail_mass = float(torch.softmax(logits[0], -1)[512:].sum())
    row = _row(temperature=1.0, seed=3)
    picks = torch.tensor([sample(logits.clone(), [row])[0] for _ in range(draws)])
    assert abs(float((picks >= 512).float().mean()) - tail_mass) < 0.04
    nucleus = {sample(logits.clone(), [_row(temperature=1.0, top_p=0.9, seed=s)])[0] for s in range(300)}
    assert max(nucleus) > 512


def test_a_tail_draw_in_one_row_leaves_the_others_alone() -> None:
    """Row 1 spreads its mass over the whole vocabulary, so its draws often land past the candidates; row 0 can only
    pick 3 tokens (the rest masked as a grammar would). Row 0 never draws from a tail it does not have."""
    vocab = 50_000
    for seed in range(20):
        logits = torch.zeros(2, vocab)
        logits[0] = float("-inf")
        logits[0, [5, 6, 7]] = 0.0
        rows = [_row(temperature=1.0, seed=seed), _row(temperature=1.0, seed=1000 + seed)]
        assert sample(logits, rows)[0] in (5, 6, 7)


def test_only_rows_without_a_nucleus_or_top_k_have_a_tail() -> None:
    """Beside a near-flat row with no top-k/top-p (its draws land past the candidates as often as its tail's mass
    says), a top-p row of the same distribution and a top-k row stay inside their own cut."""
    vocab, draws = 2048, 1500
    logits = (-0.001 * torch.arange(vocab, dtype=torch.float32)).repeat(3, 1)
    tail_mass = float(torch.softmax(logits[0], -1)[512:].sum())
    rows = [_row(temperature=1.0, top_p=0.2, seed=1), _row(temperature=1.0, seed=2), _row(temperature=1.0, top_k=4)]
    picks = torch.tensor([sample(logits.clone(), rows) for _ in range(draws)])
    nucleus = int(torch.searchsorted(torch.softmax(logits[0], -1).cumsum(0), torch.tensor(0.2))) + 1
    assert int(picks[:, 0].max()) < nucleus and int(picks[:, 2].max()) < 4
    assert abs(float((picks[:, 1] >= 512).float().mean()) - tail_mass) < 0.05


def test_a_row_draws_the_same_beside_a_companion_that_sorts_everything() -> None:
    """A row without top-k/top-p over a near-flat distribution keeps its own candidate window (and tail) while a
    companion's wide nucleus makes that companion sort its whole vocabulary: its seeded draws match its draws alone."""
    vocab = 8192
    flat = -0.0001 * torch.arange(vocab, dtype=torch.float32)

    def draws(companion: bool) -> list[int]:
        rows = [_row(temperature=1.0, seed=11)] + ([_row(temperature=1.0, top_p=0.99, seed=3)] if companion else [])
        logits = flat.repeat(len(rows), 1)
        return [sample(logits.clone(), rows)[0] for _ in range(60)]

    alone = draws(companion=False)
    assert draws(companion=True) == alone and max(alone) >= 512  # it does draw from its tail


def test_logprobs_put_the_chosen_token_first_among_equals() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    found = logprobs_of(logits, [2], top=2)[0]
    assert found.token_id == 2 and [token for token, _ in found.top] == [2, 1]
    assert abs(found.logprob - float(torch.log_softmax(logits, -1)[0, 2])) < 1e-6


def test_min_tokens_masks_the_ending_ids_until_enough_are_out() -> None:
    logits = _logits(1)
    eos, stop = logits[0].topk(2).indices.tolist()  # the two most likely tokens end the reply
    early = SamplingParams(max_tokens=8, min_tokens=3, stop_token_ids=[stop])
    after = [int(t) for t in logits[0].topk(3).indices[2:]]

    def pick(output: list[int]) -> int:
        row = SamplingRow(early, [], output, logits_processors(early, {eos}), None)
        return sample(logits.clone(), [row])[0]

    assert pick([]) == pick([5, 6]) == after[0]  # 0 and 2 tokens out: neither may end the reply
    assert pick([5, 6, 7]) == eos  # 3 out: the mask is gone


def test_min_tokens_lets_eos_through_when_nothing_else_is_allowed() -> None:
    """A grammar whose JSON is complete allows EOS alone: the reply must end there rather than draw from nothing."""
    params = SamplingParams(max_tokens=8, min_tokens=5)
    logits = torch.zeros(1, VOCAB)
    logits[0, 1:] = float("-inf")
    assert sample(logits, [SamplingRow(params, [], [], logits_processors(params, {0}), None)]) == [0]
