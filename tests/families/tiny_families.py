"""Tiny random-weight causal LMs of the popular architecture families, built from their transformers configs.

Each family is a name `AutoConfig.for_model` knows and the settings that make it a family's own: a sliding window
of `WINDOW` positions (shorter than the test prompts, so the window matters), mixed full and sliding layers,
mixture-of-experts. The vocabulary is small (`VOCAB`) so a model builds in milliseconds.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 512
WINDOW = 8
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE: dict[str, Any] = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# family -> (model_type, its own settings)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Llama": ("llama", {}),
    "Mistral (sliding window)": ("mistral", dict(sliding_window=WINDOW)),
    "Ministral (sliding window)": ("ministral", dict(sliding_window=WINDOW)),
    "Qwen2": ("qwen2", {}),
    "Qwen3": ("qwen3", {}),
    "Qwen3-MoE": ("qwen3_moe", MOE),
    "Gemma": ("gemma", {}),
    "Gemma 2 (sliding + full)": ("gemma2", dict(sliding_window=WINDOW)),
    "Gemma 3 (sliding + full)": ("gemma3_text", dict(sliding_window=WINDOW, sliding_window_pattern=2)),
    "Phi-3 (sliding window)": ("phi3", dict(sliding_window=WINDOW)),
    "gpt-oss (sliding + full, MoE)": ("gpt_oss", dict(sliding_window=WINDOW, num_local_experts=4,
                                                       num_experts_per_tok=2)),
    "Cohere2 (sliding + full)": ("cohere2", dict(sliding_window=WINDOW)),
    "Granite": ("granite", {}),
    "SmolLM3": ("smollm3", {}),
    "OLMo 2": ("olmo2", {}),
    "OLMo 3 (sliding + full)": ("olmo3", dict(sliding_window=WINDOW)),
    "StarCoder2 (sliding window)": ("starcoder2", dict(sliding_window=WINDOW)),
    "EXAONE 4 (sliding + full)": ("exaone4", dict(sliding_window=WINDOW)),
    "StableLM": ("stablelm", {}),
}


LINEAR: dict[str, Any] = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                              linear_value_head_dim=16)
MAMBA2: dict[str, Any] = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16,
                              mamba_n_groups=1)  # small scans: the reference Mamba 2 pads to a chunk
# hybrids of attention and recurrent layers (states per row): prompts prefilled alone, decoded together
HYBRID_FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "Qwen3-Next (gated delta net + attention, MoE)": ("qwen3_next", {**LINEAR, **MOE, "full_attention_interval": 2,
                                                                       "shared_expert_intermediate_size": 32}),
    "Qwen3.5 (gated delta net + attention)": ("qwen3_5_text", {**LINEAR, "full_attention_interval": 2}),
    "LFM2 (short convolutions + attention)": ("lfm2", {"full_attn_idxs": [1, 3]}),
    "Falcon-H1 (Mamba 2 beside attention)": ("falcon_h1", {**MAMBA2, "mamba_d_ssm": 128}),
    "Granite 4 hybrid (Mamba 2 + attention)": ("granitemoehybrid", {
        **MAMBA2, "layer_types": ["mamba", "attention", "mamba", "attention"]}),
    "Bamba (Mamba 2 + attention)": ("bamba", {**MAMBA2, "attn_layer_indices": [1, 3]}),
    "Jamba (Mamba + attention, MoE)": ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 1,
                                                 "num_experts": 4, "expert_layer_period": 2}),
    "Nemotron-H (Mamba 2 + attention)": ("nemotron_h", {}),
    "OLMo hybrid": ("olmo_hybrid", {}),
}


def build(family: str, dtype: torch.dtype = torch.float32) -> Any:
    """The family's tiny model (seeded: the same weights every time), in eval mode."""
    model_type, settings = {**FAMILIES, **HYBRID_FAMILIES}[family]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**COMMON, **settings})
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
