"""In-situ quantization of every family in `tiny_families` on CPU, then served by the step scheduler: the Linears are
replaced (int8 rows for the 8-bit names, torchao int4 groups of 32 for the 4-bit ones), the quantized weights are the
ones computing, and a greedy reply in a busy batch of 8 equals the reply alone. Exact equality with the float model is
not expected after quantization. MoE experts (3-D tensors, not `nn.Linear`s) and the router stay in the model's
dtype: what is quantized is the attention, the dense MLPs and the output head.

On CPU every ISQ name is one of two formats (`torchao_backend`'s table): checked for all of them here, and the two
formats served per family with Q8_0 and Q4K."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rayrunner.quantization import VALID_NAMES, parse_isq, quantize_model
from rayrunner.quantization.int8_rows import Int8Linear
from rayrunner.quantization.torchao_backend import plans_for
from tests.families.drive import prompts, replies
from tests.families.test_batched_families import FAST
from tests.families.tiny_families import FAMILIES, build

pytestmark = pytest.mark.usefixtures("one_thread")

INT8_ROWS = "rayrunner int8 weight-only per-channel (CPU)"
INT4_G32 = "torchao int4 weight-only g32 (CPU)"
SERVED = {"Q8_0": INT8_ROWS, "Q4K": INT4_G32}  # one level per CPU format
MOE = {"Qwen3-MoE", "gpt-oss (sliding + full, MoE)"}


def test_every_isq_name_is_one_of_two_cpu_formats() -> None:
    """So serving Q8_0 and Q4K per family covers every level's CPU format."""
    firsts = {name: plans_for(parse_isq(name), "cpu")[0].applied for name in VALID_NAMES}
    assert set(firsts.values()) == set(SERVED.values())
    assert {name for name, applied in firsts.items() if applied == INT4_G32} == {
        "Q4_0", "Q4_1", "Q2K", "Q3K", "Q4K", "HQQ4", "2", "3", "4"}


def _plain_weights(model: torch.nn.Module) -> list[str]:
    """Names of the model's float matrices that are still plain tensors (not quantized)."""
    return [name for name, param in model.named_parameters()
            if param.dim() >= 2 and type(param.data) is torch.Tensor]


@pytest.mark.parametrize("isq", list(SERVED))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_quantized_family_decodes_in_a_busy_batch_as_alone(family: str, isq: str,
                                                              loop: asyncio.AbstractEventLoop,
                                                              tokenizer: object) -> None:
    model = build(family)
    ids = torch.tensor([prompts()[-1]])
    with torch.inference_mode():
        before = model(ids).logits
    report = quantize_model(model, isq, "cpu")
    assert report["applied"] == SERVED[isq] and not report["fallback_layers"] and not report["skipped_layers"]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | Int8Linear)]
    assert report["quantized_layers"] == len(linears)
    assert all(type(m) is Int8Linear if isq == "Q8_0" else type(m.weight.data) is not torch.Tensor for m in linears)
    # what stays in float: the input embedding, and a MoE's experts and router
    plain = {name.split(".")[-2] if "experts" in name else name.rsplit(".", 1)[0].split(".")[-1]
             for name in _plain_weights(model)}
    assert plain == ({"embed_tokens", "experts", "gate" if family == "Qwen3-MoE" else "router"} if family in MOE
                     else {"embed_tokens"})
    with torch.inference_mode():
        after = model(ids).logits
    assert not torch.equal(before, after)  # the quantized weights compute
    assert float(torch.corrcoef(torch.stack([before.flatten(), after.flatten()]))[0, 1]) > 0.9
    busy, scheduler = replies(model, loop, tokenizer, prompts(), busy=True)
    alone, _ = replies(model, loop, tokenizer, prompts(), busy=False)
    assert scheduler.max_running == 8
    assert (scheduler.fast_decode is not None) == (family in FAST)
    assert busy == alone
