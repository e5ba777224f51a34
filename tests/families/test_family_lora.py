"""A LoRA adapter on every family in `tiny_families`, served through the step scheduler's `LoraAdapters` as the text
engine serves one: a random peft adapter (B not zero, so it changes the model) on the attention projections, saved
to a folder and loaded from it. In one busy batch of 8 rows, half with the adapter and half on the base model, every
reply equals the reply alone and peft's own `generate` (float32), and the adapter's replies differ from the base's.
With an adapter loaded the decode runs transformers' forward through peft (`adapter_names` per row), never the fast
step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from rayrunner.engines.lora import LoraAdapters
from tests.families.drive import generate, prompts, replies
from tests.families.tiny_families import FAMILIES, build

pytestmark = pytest.mark.usefixtures("one_thread")

# the attention projections, by the names the families give them (Phi-3 fuses q/k/v into one `qkv_proj`)
TARGETS = ["q_proj", "v_proj", "qkv_proj"]
ADAPTER = "tuned"


def _adapter(family: str, folder: Path) -> list[str]:
    """Save a random adapter for `family` in `folder`; the modules it wraps."""
    config = LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = get_peft_model(build(family), config)
    peft_model.save_pretrained(str(folder))
    return sorted({name.rsplit(".", 1)[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_adapter_in_a_mixed_busy_batch_equals_alone_and_peft(family: str, loop: asyncio.AbstractEventLoop,
                                                                  tokenizer: object, tmp_path: Path) -> None:
    wrapped = _adapter(family, tmp_path)
    assert wrapped == (["qkv_proj"] if family.startswith("Phi-3") else ["q_proj", "v_proj"])
    names = [ADAPTER if row % 2 == 0 else None for row in range(8)]  # adapter rows and base rows, interleaved

    def served(busy: bool) -> list[list[int]]:
        model = build(family)
        adapters = LoraAdapters(model, max_adapters=1)
        adapters.register(ADAPTER, str(tmp_path))
        out, scheduler = replies(model, loop, tokenizer, prompts(), busy, adapters, names)
        assert scheduler.max_running == 8 and adapters.loaded == [ADAPTER]
        return out

    busy, alone = served(busy=True), served(busy=False)
    reference = PeftModel.from_pretrained(build(family), str(tmp_path)).eval()
    with_adapter = [generate(reference, p) for p in prompts()]
    with reference.disable_adapter():
        base = [generate(reference, p) for p in prompts()]
    expected = [with_adapter[row] if name else base[row] for row, name in enumerate(names)]
    assert busy == alone == expected
    assert all(with_adapter[row] != base[row] for row, name in enumerate(names) if name)
