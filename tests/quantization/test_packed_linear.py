"""bf16 Linears prepacked for oneDNN: same outputs as the plain weights, q/k/v and gate/up sharing one packed weight
and unpacked exactly, tied weights kept for the embedding, plain
again for peft, parked plain and packed again by the restore, and counted in the model's weight bytes. Only on CPUs
where packing pays (a native bf16 GEMM); elsewhere nothing is packed, which the last test checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM

from rayrunner.engines.parked_weights import ParkedWeights
from rayrunner.quantization.packed_linear import (
    PackedLinear,
    fused_pack,
    pack_linears,
    packing_pays,
    unpack_linears,
)
from rayrunner.quantization.weights import weight_bytes
from tests.tiny_models import build_tiny_llama

needs_packing = pytest.mark.skipif(not packing_pays(), reason="this CPU has no native bf16 GEMM: nothing is packed")
QKV = ("q_proj", "k_proj", "v_proj")
IDS = torch.tensor([[1, 5, 9, 14, 3], [7, 2, 8, 4, 6]])


def _model(path: Path, tied: bool = False) -> Any:
    model = AutoModelForCausalLM.from_pretrained(build_tiny_llama(path), dtype=torch.bfloat16)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _logits(model: Any) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=IDS).logits.float()


def _packed(model: nn.Module) -> list[PackedLinear]:
    return [module for module in model.modules() if isinstance(module, PackedLinear) and module.is_packed]


@needs_packing
def test_packed_linears_give_the_plain_weights_outputs(tmp_path: Path) -> None:
    model = _model(tmp_path)
    plain, plain_bytes = _logits(model), weight_bytes(model)
    linears = sum(type(module) is nn.Linear for module in model.modules())
    assert pack_linears(model) == linears > 0
    assert all(linear.weight is None for linear in _packed(model))  # the plain copies are gone
    torch.testing.assert_close(_logits(model), plain, atol=0.02, rtol=0.02)
    assert abs(weight_bytes(model) - plain_bytes) <= 0.05 * plain_bytes
    assert pack_linears(model) == 0  # packing twice packs nothing


@needs_packing
def test_linears_reading_one_input_share_one_packed_weight_and_unpack_exactly(tmp_path: Path) -> None:
    model = _model(tmp_path)
    layer = model.model.layers[0]
    plain = {name: linear.weight.clone() for name, linear in layer.named_modules() if isinstance(linear, nn.Linear)}
    pack_linears(model)
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.q_proj.fused is attention.k_proj.fused is attention.v_proj.fused is not None
    assert mlp.gate_proj.fused is mlp.up_proj.fused is not None and mlp.down_proj.fused is None
    assert [fused_pack(attention, QKV), fused_pack(mlp, ("gate_proj", "up_proj"))] == [attention.q_proj.fused,
                                                                                       mlp.up_proj.fused]
    unpack_linears(model)
    for name, weight in plain.items():
        assert torch.equal(layer.get_submodule(name).weight, weight), name


@needs_packing
def test_a_shared_packed_weight_serves_each_linear_its_own_output_with_biases() -> None:
    torch.manual_seed(0)
    owner = nn.Module()
    for name, rows in zip(QKV, (12, 4, 4), strict=True):
        setattr(owner, name, nn.Linear(16, rows, bias=True, dtype=torch.bfloat16))
    expected = {}
    first, second = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(3, 16, dtype=torch.bfloat16)
    for x in (first, second):
        expected[id(x)] = [torch.nn.functional.linear(x, getattr(owner, n).weight, getattr(owner, n).bias)
                           for n in QKV]
    assert pack_linears(owner) == 3
    fused = owner.q_proj.fused
    # in transformers' order, out of order, one input and then another before the first is done
    for x, order in ((first, QKV), (second, ("v_proj", "q_proj", "k_proj")), (first, ("q_proj",)),
                     (second, QKV)):
        for name in order:
            got = getattr(owner, name)(x)
            torch.testing.assert_close(got, expected[id(x)][QKV.index(name)], atol=0.02, rtol=0.02)
    assert fused._output is None  # the last input was served to all three: its output is not held


@needs_packing
def test_a_tied_head_keeps_the_embeddings_weight(tmp_path: Path) -> None:
    model = _model(tmp_path, tied=True)
    plain = _logits(model)
    pack_linears(model)
    assert model.lm_head.packed is not None and model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(_logits(model), plain, atol=0.02, rtol=0.02)
    unpack_linears(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@needs_packing
def test_parked_packed_weights_come_back_packed_and_the_same(tmp_path: Path) -> None:
    model = _model(tmp_path / "model", tied=True)
    plain = _logits(model)
    pack_linears(model)
    packed = len(_packed(model))
    parking = ParkedWeights("tiny", tmp_path / "parked")
    parking.park(model)  # makes the packed weights plain to write them, then drops them
    assert not _packed(model) and all(linear.weight is None for linear in model.modules()
                                      if isinstance(linear, nn.Linear))
    parking.restore()
    assert len(_packed(model)) == packed > 0 and pack_linears(model) == 0
    torch.testing.assert_close(_logits(model), plain, atol=0.02, rtol=0.02)
    parking.discard()


@needs_packing
def test_peft_wraps_plain_linears_and_they_stay_plain(tmp_path: Path) -> None:
    model = _model(tmp_path)
    pack_linears(model)
    unpack_linears(model)  # as LoraAdapters does before peft wraps the Linears
    config = LoraConfig(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft = get_peft_model(model, config)
    before = _logits(peft)
    packed = pack_linears(peft)  # a wake packs again, but not the layers peft wraps
    assert packed > 0 and all(layer.base_layer.packed is None for name, layer in peft.named_modules()
                              if name.endswith(("q_proj", "v_proj")) and hasattr(layer, "base_layer"))
    torch.testing.assert_close(_logits(peft), before, atol=0.02, rtol=0.02)


def test_float32_linears_are_never_packed(tmp_path: Path) -> None:
    model = _model(tmp_path).float()
    assert pack_linears(model) == 0 and not _packed(model)
