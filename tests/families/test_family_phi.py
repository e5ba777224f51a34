"""Phi-1 / Phi-2 (`phi`: partial rotary embedding, parallel attention and MLP, LayerNorm) batches like the families
in `tiny_families`: a greedy reply in a busy batch of 8 equals the reply alone and transformers' `generate`.

Why a reply once looked different from `generate`: not positions or masks (the scheduler's logits equal the model's
own at every step, bit for bit), but EOS. `generate(min_new_tokens=N)` masks EOS for N tokens and takes the next best
token, while a sequence given no EOS ids emits EOS and goes on. A random model's greedy choice is sometimes EOS:
this one's is at the 7th token of its 4th prompt. Replies compared with `generate(min_new_tokens=N)` must mask EOS
the same way (`SamplingParams.min_tokens` with the model's EOS ids: `drive.replies` does)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.families.drive import generate, prompts, replies
from tests.families.tiny_families import COMMON

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 2


@pytest.fixture(scope="module")
def phi() -> Any:
    settings = {key: value for key, value in COMMON.items() if key != "head_dim"}  # phi: hidden / heads
    torch.manual_seed(2)
    config = AutoConfig.for_model("phi", **{**settings, "num_key_value_heads": 4}, partial_rotary_factor=0.4)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_phi_in_a_busy_batch_equals_alone_and_generate(phi: Any, loop: asyncio.AbstractEventLoop,
                                                       tokenizer: object) -> None:
    busy, scheduler = replies(phi, loop, tokenizer, prompts(), busy=True)
    alone, _ = replies(phi, loop, tokenizer, prompts(), busy=False)
    assert scheduler.max_running == 8 and scheduler.fast_decode is None
    assert busy == alone == [generate(phi, p) for p in prompts()]


def test_a_reply_that_emits_eos_differs_from_generate_only_from_there(phi: Any, loop: asyncio.AbstractEventLoop,
                                                                      tokenizer: object) -> None:
    unmasked, _ = replies(phi, loop, tokenizer, prompts(), busy=True, eos_ids=set())
    expected = [generate(phi, p) for p in prompts()]
    differing = [row for row in range(8) if unmasked[row] != expected[row]]
    assert differing  # this model's greedy choice is EOS somewhere
    for row in differing:
        at = unmasked[row].index(EOS)
        assert unmasked[row][:at] == expected[row][:at] and expected[row][at] != EOS
