"""The logits stage that applies each request's sampling settings to one decode step of a whole batch.

Every sequence in a step keeps its own settings: the stage first runs each row's logits processors (penalties,
logit bias; later features such as constrained decoding add processors of their own), then picks each row's token.
Greedy rows take the argmax together; sampled rows are filtered together (temperature, top-k, top-p, min-p) and draw
with their own `torch.Generator`, so a seeded reply does not depend on which requests share its batch (up to the
rounding of its logits, which in bf16 differs a little inside a padded batch).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from rayrunner.openai.sampling_params import LogitsProcessor, SamplingParams

# How many of its most likely tokens a row is sampled from, widening while a top-p nucleus reaches past them, before
# the whole vocabulary is sorted (see `_draw`): top-k of 512 or 4096 costs 2.5 or 5.6 ms for 16 rows of SmolLM2's
# 49k vocabulary on this 2-core CPU, a full sort 28 ms.
_CANDIDATES = (512, 4096)
# Greedy rows find their argmax in blocks of this many logits (`greedy_tokens`).
_GREEDY_BLOCK = 128


def logits_processors(params: SamplingParams, eos_ids: Collection[int] = ()) -> list[LogitsProcessor]:
    """A row's logits processors, in the order they apply (only those its settings switch on); `eos_ids` are
    the ids that end the row's reply besides its `stop_token_ids`."""
    found: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        found.append(_repetition_penalty(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        found.append(_openai_penalties(params.presence_penalty, params.frequency_penalty))
    if params.logit_bias:
        found.append(_logit_bias(params.logit_bias))
    if params.constraint is not None:
        found.append(params.constraint(params.max_tokens))  # nothing after it may re-allow a forbidden token
    if params.min_tokens:
        found.append(_min_tokens(params.min_tokens, {*eos_ids, *params.stop_token_ids}))
    return found



def _repetition_penalty(penalty: float) -> LogitsProcessor:
    """HF/vLLM meaning: every token seen in the prompt or the output is made less likely by `penalty`."""

    def apply(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
        return logits

    return apply


def _openai_penalties(presence: float, frequency: float) -> LogitsProcessor:
    """OpenAI's meaning: subtract `presence` once and `frequency` per occurrence, for generated tokens only."""

    def apply(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        if not output:
            return logits
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
        counts = counts[: logits.shape[-1]].to(logits.dtype)
        return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts

    return apply


def _logit_bias(bias: dict[int, float]) -> LogitsProcessor:
    ids = list(bias)
    values = list(bias.values())

    def apply(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.long, device=logits.device)
        logits[index] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
        return logits

    return apply


def _min_tokens(count: int, ending: set[int]) -> LogitsProcessor:
    """vLLM's `min_tokens`: the ids that would end the reply are masked while fewer than `count` tokens are out,
    unless nothing else is left to choose (a grammar whose JSON is complete allows EOS alone: the reply ends)."""
    ids = sorted(ending)

    def apply(prompt: list[int], output: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output) >= count or not ids:
            return logits
        index = torch.tensor([i for i in ids if i < logits.shape[-1]], dtype=torch.long, device=logits.device)
        kept = logits[index]  # masked in place (no copy of the row), put back if nothing else is left
        logits.index_fill_(0, index, float("-inf"))
        if not bool(logits.max() > float("-inf")):
            logits.index_copy_(0, index, kept)
        return logits

    return apply


@dataclass
class SamplingRow:
    """What the logits stage needs to know about one row of the batch."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    processors: list[LogitsProcessor]
    generator: torch.Generator | None


def new_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A row's own random stream: seeded when the request gives a seed, else from fresh entropy."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


@dataclass
class Logprob:
    """A token id's log probability and the `top` (id, logprob) pairs at its position, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[Logprob]:
    """Each row's `tokens[row]` under the log-softmax of that row of `logits` ([rows, vocab], the model's raw
    logits: before penalties, bias and temperature), with the row's `top` most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(list(tokens), dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    if top:
        values, ids = logprobs.topk(top, dim=-1)
        pairs = [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    else:
        pairs = [[] for _ in chosen]
    for token, row in zip(tokens, pairs, strict=True):  # among equal logprobs the chosen token comes first
        row.sort(key=lambda pair: (-pair[1], pair[0] != token))
    return [Logprob(t, c, p) for t, c, p in zip(tokens, chosen, pairs, strict=True)]


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """One token per row from `logits` ([rows, vocab], any float dtype)."""
    logits = logits.float()
    for i, row in enumerate(rows):
        for processor in row.processors:
            logits[i] = processor(row.prompt_ids, row.output_ids, logits[i])
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if len(sampled) == len(rows):
        return [int(t) for t in _draw(logits, rows).tolist()]
    tokens = greedy_tokens(logits)
    if sampled:
        tokens[sampled] = _draw(logits[sampled], [rows[i] for i in sampled])
    return [int(t) for t in tokens.tolist()]


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for [rows, vocab], ties and NaN alike (the first of the largest, NaN counting as largest),
    found in two passes: the block holding it by each block's vectorized maximum, then the place in that block.
    PyTorch's CPU argmax walks the vocabulary one logit at a time (0.65 ms for 16 rows of 49k; this: 0.08 ms)."""
    rows, vocab = logits.shape
    if vocab % _GREEDY_BLOCK or vocab < 4 * _GREEDY_BLOCK:
        return torch.argmax(logits, dim=-1)
    blocks = logits.view(rows, vocab // _GREEDY_BLOCK, _GREEDY_BLOCK)
    block = blocks.amax(dim=-1).argmax(dim=-1)
    inside = blocks[torch.arange(rows, device=logits.device), block].argmax(dim=-1)
    return block * _GREEDY_BLOCK + inside


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Filter every sampled row (top-k, then top-p on the top-k renormalised as transformers does, then min-p), then
    draw each row by inverse CDF with one uniform from its own generator.

    Sorting the whole vocabulary, or drawing over all of it, costs more than a small model's forward pass, so each
    row's work runs on its most likely `_CANDIDATES` tokens (or its larger top_k), after one softmax over the
    vocabulary. That stays exact: a row whose top-p nucleus reaches past them widens its window, up to a full sort,
    and a row with no top-k/top-p keeps the rest as a tail that a draw lands in with exactly the tail's probability
    (then drawn over the whole vocabulary). Windows are per row, so one flat distribution does not sort everyone's
    vocabulary (16 rows at temperatures up to 1.25: 15.7 ms a step when they shared the widest window), and a row's
    window, hence its draw, never depends on its companions."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    probs = torch.softmax(logits / temperature, dim=-1)
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    pending = list(range(len(rows)))
    for candidates in sorted({min(vocab, w) for w in (*_CANDIDATES, vocab)}):
        if not pending:
            break
        group = [rows[i] for i in pending]
        width = min(vocab, max(candidates, *(r.params.top_k for r in group)))  # every top-k whole
        index = torch.tensor(pending, device=device)
        window = _Window(probs[index], group, width)
        fits = window.fits().tolist()
        done = [row for row, fit in enumerate(fits) if fit]
        if done:
            tokens[index[done]] = window.pick(done)
        pending = [i for i, fit in zip(pending, fits, strict=True) if not fit]
    return tokens


class _Window:
    """Sampled rows' `width` most likely tokens (the whole vocabulary sorted when `width` is its size)."""

    def __init__(self, probs: torch.Tensor, rows: Sequence[SamplingRow], width: int) -> None:
        device, vocab = probs.device, probs.shape[-1]
        self.probs, self.rows, self.width, self.vocab = probs, rows, width, vocab
        self.top, self.ids = probs.sort(dim=-1, descending=True) if width == vocab else probs.topk(width, dim=-1)
        self.k = torch.tensor([r.params.top_k or vocab for r in rows], device=device).unsqueeze(1)
        self.p = torch.tensor([r.params.top_p for r in rows], device=device).unsqueeze(1)
        self.min_p = torch.tensor([r.params.min_p for r in rows], device=device).unsqueeze(1)
        self.unbounded = (self.k > width) & (self.p >= 1.0)  # distributions that go on past the window

    def fits(self) -> torch.Tensor:
        """Per row: its top-k, its top-p nucleus or its tail rule holds within the window."""
        return ((self.top.sum(-1, True) >= self.p) | (self.k <= self.width) | self.unbounded
                | (self.width == self.vocab)).squeeze(1)

    def pick(self, chosen: list[int]) -> torch.Tensor:
        """The drawn token of each row in `chosen` (rows that fit)."""
        device = self.probs.device
        index = torch.tensor(chosen, device=device)
        top, ids, k, p = self.top[index], self.ids[index], self.k[index], self.p[index]
        floor = self.min_p[index] * top[:, :1]  # min-p's threshold: a share of the most likely token's probability
        ranks = torch.arange(self.width, device=device).unsqueeze(0)
        kept = top.masked_fill(ranks >= k, 0.0)
        share = kept / kept.sum(-1, True)
        before = share.cumsum(-1) - share  # the mass of the candidates ranked above this one
        kept = kept.masked_fill(((before >= p) & (p < 1.0)) | (kept < floor), 0.0)
        tail = torch.zeros_like(floor)
        with_tail = (self.unbounded[index] & (self.width < self.vocab)).squeeze(1).nonzero().flatten()
        if len(with_tail):
            tail[with_tail] = _tail(self.probs[index[with_tail]], top[with_tail], floor[with_tail])
        rows = [self.rows[i] for i in chosen]
        cdf = kept.cumsum(-1)
        uniform = torch.cat([torch.rand(1, generator=r.generator, device=device) for r in rows]).unsqueeze(1)
        target = uniform * (cdf[:, -1:] + tail)
        tokens = ids.gather(1, torch.searchsorted(cdf, target).clamp(max=self.width - 1)).squeeze(1)
        landed_in_tail = ((target >= cdf[:, -1:]) & (tail > 0)).squeeze(1)
        for i in torch.nonzero(landed_in_tail).flatten().tolist():
            rest = self.probs[chosen[i]].scatter(0, ids[i], 0.0)
            tokens[i] = torch.multinomial(rest.masked_fill(rest < floor[i], 0.0), 1, generator=rows[i].generator)[0]
        return tokens


def _tail(probs: torch.Tensor, top: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The probability past the candidates `top` that a draw can land in, per row ([rows, 1]), from the rows' whole
    distributions. A tail exists only if some token past the candidates can be drawn (counted exactly: the mass
    alone can be a rounding error's worth above zero when a mask, such as a grammar's, leaves every live token among
    the candidates)."""
    above = probs.masked_fill(probs < floor, 0.0).sum(-1, True) - top.masked_fill(top < floor, 0.0).sum(-1, True)
    beyond = _live(probs, floor).sum(-1, True) > _live(top, floor).sum(-1, True)
    return torch.where(beyond, above.clamp(min=0.0), 0.0)


def _live(probs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """The tokens a draw can pick: positive probability, not under the min-p floor."""
    return (probs > 0.0) & (probs >= floor)
