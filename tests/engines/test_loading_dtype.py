"""`dtype: auto` loads in the dtype the model's config names (float16 as bf16 on CPU), and an explicit dtype wins:
tiny Llama folders saved in each dtype, loaded on CPU as a model replica loads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from rayrunner.engines import loading
from rayrunner.engines.loading import load_model, pick_dtype
from rayrunner.models.spec import build_spec
from tests.tiny_models import build_tiny_llama


def _saved(folder: Path, dtype: torch.dtype | None, key: str = "dtype") -> str:
    """The tiny Llama saved in `dtype`, its config naming it under `key` (None: naming none, as a GGUF's)."""
    build_tiny_llama(folder)
    config = LlamaConfig.from_pretrained(folder)
    LlamaForCausalLM(config).to(dtype or torch.float32).save_pretrained(str(folder))
    path = folder / "config.json"
    body = json.loads(path.read_text())
    body.pop("dtype", None)
    body.pop("torch_dtype", None)
    if dtype is not None:
        body[key] = str(dtype).removeprefix("torch.")
    path.write_text(json.dumps(body))
    return str(folder)


def _loaded_dtype(folder: str, dtype: str = "auto") -> tuple[str, torch.dtype]:
    spec = build_spec("tiny", {"type": "plain", "model_id": folder, "dtype": dtype}, engine={"device": "cpu"})
    loaded = load_model(spec, AutoModelForCausalLM)
    return loaded.dtype, next(loaded.model.parameters()).dtype


@pytest.mark.parametrize(
    ("saved", "key", "expected"),
    [
        (torch.float32, "dtype", torch.float32),
        (torch.bfloat16, "dtype", torch.bfloat16),
        (torch.float32, "torch_dtype", torch.float32),  # an older config's key
        (torch.float16, "dtype", torch.bfloat16),  # on CPU: same bytes, and the CPU's fast paths
        (None, "dtype", torch.bfloat16),  # a config that names none
    ],
)
def test_auto_loads_the_configs_dtype(tmp_path: Path, saved: torch.dtype | None, key: str,
                                      expected: torch.dtype) -> None:
    reported, weights = _loaded_dtype(_saved(tmp_path, saved, key))
    assert weights == expected and reported == str(expected).removeprefix("torch.")


def test_an_explicit_dtype_wins_over_the_config(tmp_path: Path) -> None:
    folder = _saved(tmp_path, torch.float32)
    assert _loaded_dtype(folder, "bf16")[1] == torch.bfloat16
    assert _loaded_dtype(folder, "f16")[1] == torch.float16


@pytest.mark.parametrize(("declared", "bf16_gpu", "expected"), [
    (torch.float16, True, torch.float16),
    (torch.bfloat16, True, torch.bfloat16),
    (torch.float32, True, torch.float32),
    (None, True, torch.bfloat16),
    (torch.bfloat16, False, torch.float16),  # a GPU without bf16
    (None, False, torch.float16),
])
def test_auto_on_a_gpu(monkeypatch: pytest.MonkeyPatch, declared: torch.dtype | None, bf16_gpu: bool,
                       expected: torch.dtype) -> None:
    monkeypatch.setattr(loading.torch.cuda, "is_bf16_supported", lambda: bf16_gpu)
    config = LlamaConfig(dtype=declared)
    assert pick_dtype("auto", config, "cuda") == expected
    assert pick_dtype("f32", config, "cuda") == torch.float32


def test_a_multimodal_config_may_name_it_in_its_text_config() -> None:
    from transformers import LlavaConfig

    config = LlavaConfig(text_config={"model_type": "llama", "dtype": "float32"})
    config.dtype = None
    assert pick_dtype("auto", config, "cpu") == torch.float32


def test_the_memory_estimate_counts_the_dtype_auto_loads(tmp_path: Path) -> None:
    from rayrunner.models.footprint import expected_weight_bytes

    def estimate(folder: str, dtype: str) -> int:  # the weights' part (the KV budget is bytes, whatever the dtype)
        return expected_weight_bytes(build_spec("tiny", {"type": "plain", "model_id": folder, "dtype": dtype}))

    f32 = _saved(tmp_path / "f32", torch.float32)
    assert estimate(f32, "auto") == estimate(f32, "f32") == 2 * estimate(f32, "bf16")
    f16 = _saved(tmp_path / "f16", torch.float16, "torch_dtype")
    assert estimate(f16, "auto") == estimate(f16, "bf16") == estimate(f16, "f32") // 2
