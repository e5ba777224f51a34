"""Per-request sampling settings and the logits stage that applies them to one decode step of a whole batch.

Every sequence in a step keeps its own settings: the stage first runs each row's logits processors (penalties,
logit bias; later features such as constrained decoding add processors of their own), then picks each row's token.
Greedy rows take the argmax together; sampled rows are filtered together (temperature, top-k, top-p, min-p) and draw
with their own `torch.Generator`, so a seeded reply does not depend on which requests share its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# A row's logits processor: (prompt ids, generated ids, logits of shape [vocab]) -> logits.
LogitsProcessor = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


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

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def processors(self) -> list[LogitsProcessor]:
        """The row's logits processors, in the order they apply (only those its settings switch on)."""
        found: list[LogitsProcessor] = []
        if self.repetition_penalty != 1.0:
            found.append(_repetition_penalty(self.repetition_penalty))
        if self.presence_penalty or self.frequency_penalty:
            found.append(_openai_penalties(self.presence_penalty, self.frequency_penalty))
        if self.logit_bias:
            found.append(_logit_bias(self.logit_bias))
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


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """One token per row from `logits` ([rows, vocab], any float dtype)."""
    logits = logits.float()
    for i, row in enumerate(rows):
        for processor in row.processors:
            logits[i] = processor(row.prompt_ids, row.output_ids, logits[i])
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, row in enumerate(rows) if not row.params.greedy]
    if sampled:
        picked = _draw(logits[sampled], [rows[i] for i in sampled])
        tokens[sampled] = picked
    return [int(t) for t in tokens.tolist()]


def _draw(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Filter every sampled row at once, then draw each with its own generator."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [r.params.top_k for r in rows]
    top_p = [r.params.top_p for r in rows]
    min_p = [r.params.min_p for r in rows]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    if any(p > 0 for p in min_p):
        floor = torch.tensor(min_p, device=device).unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    # Exponential race (equivalent to drawing from `probs`): the argmax of p / E with E ~ Exp(1) from the row's own
    # generator. A tiny change in p (another batch's rounding) moves the pick only near a tie, as with greedy,
    # where inverse-CDF sampling would shift with every rounding error summed over the vocabulary.
    noise = torch.stack([torch.empty_like(p).exponential_(generator=row.generator)
                         for p, row in zip(probs, rows, strict=True)])
    return torch.argmax(probs / noise, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Logits with everything outside each row's top-k and top-p nucleus set to -inf (one sort for all rows)."""
    vocab = logits.shape[-1]
    ordered, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # probability mass of the tokens ranked above this one
    p = torch.tensor(top_p, device=logits.device).unsqueeze(1)
    drop |= (before >= p) & (p < 1.0)
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)
