"""LoRA adapters on SmolLM2, in-process: random adapters (not no-ops) change the reply, match peft's own generate
token for token, share a batch with each other and the base model without changing anyone's reply, and at most
`max_adapters` stay loaded (least recently used evicted, reloaded when asked for again)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from rayrunner.engines.lora import LoraAdapters, adapter_folder
from rayrunner.engines.transformers.text import TextEngine
from rayrunner.errors import InvalidRequestError, ModelLoadError
from rayrunner.models.sources import SMOLLM2, resolve
from rayrunner.models.spec import build_spec
from rayrunner.models.which import Which
from rayrunner.openai.sampling_params import SamplingParams
from rayrunner.protocol import ChatCompletionRequest, CompletionRequest
from rayrunner.replica.model_server import _request_adapter

PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea."]


def _base(dtype: torch.dtype = torch.bfloat16) -> Any:
    return AutoModelForCausalLM.from_pretrained(resolve(SMOLLM2).path, dtype=dtype)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Three random adapters on q_proj/v_proj (`init_lora_weights=False`: B is not zero, so each changes the model)."""
    torch.set_num_threads(2)
    folders = {}
    for seed, name in enumerate(["alpha", "beta", "gamma"]):
        torch.manual_seed(seed)
        config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        get_peft_model(_base(), config).save_pretrained(str(folder))
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def engine() -> TextEngine:
    """In float32: in bf16 these prompts meet near-ties that a padded batch's rounding breaks the other way (with or
    without adapters), and exact ties that peft's `generate` and the scheduler's kernels break differently."""
    torch.set_num_threads(2)
    spec = {"type": "plain", "model_id": SMOLLM2, "dtype": "f32"}
    return TextEngine(build_spec("smol", spec, engine={"max_adapters": 2}))


async def _chat(engine: TextEngine, text: str, adapter: str | None = None) -> str:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": text}])
    return "".join([e.text async for e in engine.chat(request, SamplingParams(max_tokens=12), adapter)])


def test_lora_which_parses_from_its_dict() -> None:
    which = Which.parse({"type": "lora", "model_id": SMOLLM2, "adapter": "me/my-adapter"})
    assert which == Which.Lora(model_id=SMOLLM2, adapter="me/my-adapter") and which.kind == "text"


def test_a_mixed_batch_gives_each_row_its_adapters_logits(adapters: dict[str, str]) -> None:
    """One forward over rows (a, base, b) against each row alone; base rows also against the model before peft."""
    model = _base()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]] * 3)
    with torch.inference_mode():
        plain = model(input_ids=ids[:1]).logits
        lora = LoraAdapters(model, max_adapters=2)
        for name in ("alpha", "beta"):
            lora.register(name, adapters[name])
        rows: list[str | None] = ["alpha", None, "beta"]
        mixed = lora.forward(rows, (), input_ids=ids).logits
        alone = [lora.forward([name], (), input_ids=ids[:1]).logits[0] for name in rows]
    for row in range(3):
        torch.testing.assert_close(mixed[row], alone[row], atol=0.05, rtol=0.02)
    torch.testing.assert_close(mixed[1], plain[0], atol=0.05, rtol=0.02)
    assert (alone[0] - plain[0]).abs().max() > 1 and (alone[2] - plain[0]).abs().max() > 1


@pytest.mark.slow
async def test_adapter_reply_differs_from_the_base_and_equals_peft(engine: TextEngine,
                                                                   adapters: dict[str, str]) -> None:
    await engine.load_adapter("alpha", adapters["alpha"])
    # loaded on the step loop's thread, yet normal tensors (inference-tensor weights make Linears copy them)
    assert not any(p.is_inference() for p in engine.model.parameters())
    request = CompletionRequest(prompt="The capital of France is")
    mine = [e async for e in engine.complete(request, SamplingParams(max_tokens=16), "alpha")]
    text = "".join(e.text for e in mine)
    ids = torch.tensor([engine.tokenizer(request.prompt_text())["input_ids"]])
    peft_model = PeftModel.from_pretrained(_base(torch.float32), adapters["alpha"])
    with torch.inference_mode():
        out = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                  do_sample=False)[0, ids.shape[1]:]
        with peft_model.disable_adapter():
            base = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                                       do_sample=False)[0, ids.shape[1]:]
    assert mine[-1].completion_tokens == len(out)
    assert text == engine.tokenizer.decode(out, skip_special_tokens=True)
    assert not torch.equal(out, base)


def test_a_lora_spec_serves_its_adapter_by_default(adapters: dict[str, str]) -> None:
    engine = TextEngine(build_spec("smol-alpha", {"type": "lora", "model_id": SMOLLM2, "adapter": adapters["alpha"]}))
    try:
        assert engine.adapters.loaded == ["smol-alpha"] and engine.default_adapter == "smol-alpha"
        assert engine.adapters.peft.get_base_model() is engine.model
    finally:
        engine.close()


@pytest.mark.slow
async def test_base_and_adapters_interleave_in_one_batch_without_reloading(engine: TextEngine,
                                                                            adapters: dict[str, str]) -> None:
    for name in ("alpha", "beta"):
        await engine.load_adapter(name, adapters[name])
    cases = [(text, adapter) for text in PROMPTS[:2] for adapter in (None, "alpha", "beta")]
    alone = [await _chat(engine, text, adapter) for text, adapter in cases]
    assert len(set(alone[:3])) == 3  # each adapter answers differently
    steps = engine.scheduler.stats()["steps"]
    with mock.patch.object(engine.adapters, "_load_weights", side_effect=AssertionError("reloaded")):
        together = await asyncio.gather(*(_chat(engine, text, adapter) for text, adapter in cases))
    assert list(together) == alone
    assert engine.scheduler.stats()["steps"] - steps < 2 * 12  # decoded together, not one request after another


@pytest.mark.slow
async def test_at_most_max_adapters_stay_loaded_least_recently_used_evicted(engine: TextEngine,
                                                                             adapters: dict[str, str]) -> None:
    await engine.load_adapter("alpha", adapters["alpha"])
    await engine.load_adapter("beta", adapters["beta"])
    first_a = await _chat(engine, PROMPTS[0], "alpha")  # alpha is now the most recently used
    await engine.load_adapter("gamma", adapters["gamma"])
    assert engine.adapters.loaded == ["alpha", "gamma"]
    assert len(engine.adapters.peft.peft_config) == 2
    b_again = await _chat(engine, PROMPTS[0], "beta")  # evicted, so reloaded from its folder (evicting alpha)
    assert engine.adapters.loaded == ["gamma", "beta"]
    assert b_again != first_a
    assert await _chat(engine, PROMPTS[0], "alpha") == first_a


@pytest.mark.slow
async def test_unknown_adapters_and_folders_are_refused(engine: TextEngine, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="not loaded"):
        await _chat(engine, PROMPTS[0], "nope")
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        await engine.load_adapter("empty", str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="broken"):
        await engine.load_adapter("broken", str(tmp_path))
    with pytest.raises(InvalidRequestError, match="not loaded"):  # forgotten, not retried on every request
        await _chat(engine, PROMPTS[0], "broken")


@pytest.mark.slow
async def test_a_new_adapter_waits_while_max_adapters_others_run(engine: TextEngine, adapters: dict[str, str]) -> None:
    for name in ("alpha", "beta", "gamma"):
        await engine.load_adapter(name, adapters[name])
    times: dict[str, tuple[float, float]] = {}

    async def timed(adapter: str, max_tokens: int) -> None:
        request = CompletionRequest(prompt="Once upon a time")
        params = SamplingParams(max_tokens=max_tokens)
        stamps = [time.monotonic() async for _ in engine.complete(request, params, adapter)]
        times[adapter] = (stamps[0], stamps[-1])

    await asyncio.gather(timed("alpha", 8), timed("beta", 8), timed("gamma", 2))
    assert times["gamma"][0] > min(times["alpha"][1], times["beta"][1])
    assert len(engine.adapters.loaded) == 2


@pytest.mark.slow
async def test_the_model_server_reads_the_adapter_from_the_body(engine: TextEngine, adapters: dict[str, str]) -> None:
    assert await _request_adapter(engine, {"model": "x"}) is None
    body = {"adapter": "delta", "adapter_source": adapters["beta"]}
    assert await _request_adapter(engine, body) == "delta" and "delta" in engine.adapters.loaded
    with pytest.raises(InvalidRequestError, match="adapter"):
        await _request_adapter(engine, {"adapter": 3})


def test_a_hub_adapter_missing_from_the_cache_is_a_load_error(tmp_path: Path) -> None:
    """Offline (as tests run) the empty cache has nothing; online the hub answers 404."""
    with pytest.raises(ModelLoadError, match="no-such/adapter"):
        adapter_folder("no-such/adapter", str(tmp_path))
