"""The decode step of Llama-family models (Llama, Mistral, Qwen2, Qwen3, and the language model of a multimodal one
such as LLaVA) in fewer, cheaper tensor operations than transformers' forward, on the same weights and the same
`BatchCache`.

A decode step feeds one token per row. For a small model eager PyTorch spends about as long dispatching the many
small operations of transformers' forward as on the matmuls themselves, so this step keeps the arithmetic and trims
the operations around it:
- hidden states stay [rows, hidden] (no sequence dimension to view, transpose and copy);
- int8 weights (`Int8Linear`) of a layer's q/k/v and of its gate/up share one tensor each (`share_storage`: views,
  no second copy), so a layer takes 4 int8 kernel calls instead of 7, made directly for a few bf16 rows; packed bf16
  weights share one packed weight each the same way (`FusedPack`);
- in bf16 on a CPU, fused operations (`fused_ops`, one call each, rounded as the operations they replace round)
  where they are built: each residual add with the RMSNorm after it, RoPE, and SiLU times up (from the gate/up
  matmul's sums where that weight is on the AMX tiles: `TileWeight.glu`); else transformers'
  operations inlined (the norms in float32, in place where they allocate a scratch tensor);
- RoPE on the query and key heads at once: the heads times the cosine plus their halves swapped (`roll`) times a
  sine whose first half is negated;
- keys and values appended into room reserved in the `BatchCache` (`append`), not concatenated;
- attention as two matmuls and a softmax over the GQA groups, without repeating the key/value heads (cheaper than
  `scaled_dot_product_attention` for one query token per row on CPUs without AMX). Up to `FLOAT32_ATTENTION_MAX`
  cached positions over all rows it computes in float32, past that in the model's dtype, where converting the cache
  would cost more than it saves; on a CPU without a native bf16 GEMM (`cpu_gemm`) always in float32. On a CPU with
  AMX tiles, PyTorch's flash SDPA (grouped heads, its blocks multiplied on the tiles) is faster and takes it.

Text prompts are prefilled through it too (`prefill`, and `PromptChunk`s beside a step), whole or after their cached
start, each on a cache of its own, their attention on the AMX tiles where it is built (`prompt_attention`: every
prompt of a forward in one call a layer, its keys and values written in place into one tensor of its cache's
layers, where transformers' cache would concatenate them layer by layer); images, LoRA
adapters (peft replaces the Linears), scored prompts and other architectures keep transformers' forward:
`FastDecode.for_model` says None for a model whose decoder layers it does not cover. Where every Linear is on the
tiles, a step of decode rows alone runs its layers in one C call (`decode_layers`). What this step gains, and what
was tried and left out, is in docs/performance.md ("Decode", "Fused operations").
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rayrunner.engines.transformers.kv.kv_batch import BatchCache, hold, layer_windows, mergeable
from rayrunner.engines.transformers.step import decode_attention, fused_ops, prompt_attention
from rayrunner.engines.transformers.step.decode_layers import LayerDriver
from rayrunner.quantization.cpu_gemm import amx_tiles, wide_dtype
from rayrunner.quantization.int8_rows import (
    KERNEL_IN_MULTIPLE,
    KERNEL_MAX_ROWS,
    Int8Linear,
    few_rows_kernel,
    int8_matmul,
    share_storage,
)
from rayrunner.quantization.packed_linear import fused_pack
from rayrunner.quantization.tile_weights import TileWeight

DECODER_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "MinistralDecoderLayer", "Qwen2DecoderLayer",
                            "Qwen3DecoderLayer"})
FLOAT32_ATTENTION_MAX = 2048  # cached positions over all rows up to which attention runs in float32 (see above)
QKV, GATE_UP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
SHARED_QDATA, SHARED_SCALE = "shared_qdata", "shared_scale"  # buffers of an attention or MLP module (see above)


class FastDecode:
    """One decode step of a supported model: `step(ids, batch)` gives the logits [rows, 1, vocab] and appends the
    step's keys and values to the batch's cache, as the model's own forward would (`BatchCache.append`)."""

    def __init__(self, decoder: Any, lm_head: Any, config: Any) -> None:
        self.decoder, self.lm_head = decoder, lm_head
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.intermediate = int(config.intermediate_size)
        for layer in decoder.layers:
            _share(layer.self_attn, QKV)
            _share(layer.mlp, GATE_UP)
        self.layers = [_Layer(layer) for layer in decoder.layers[: config.num_hidden_layers]]
        self.windows = layer_windows(config)
        self.driver = LayerDriver.for_fast(self.layers, decoder.norm, self.windows, self.heads, self.kv_heads,
                                           self.head_dim, self.intermediate)  # the layers in one C call

    @classmethod
    def for_model(cls, model: Any) -> FastDecode | None:
        """A `FastDecode` for `model` (a causal LM, or a multimodal one's language model), or None when its layers
        are not the ones covered."""
        try:
            decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
        except (AttributeError, NotImplementedError):  # not a transformers model with a decoder and a head
            return None
        if lm_head is None or not mergeable(model.config):
            return None
        if any(module._forward_hooks or module._forward_pre_hooks for module in model.modules()):
            return None  # e.g. accelerate's offload hooks: the forward does more than the module's own
        layers = getattr(decoder, "layers", None)
        if not layers or not all(type(layer).__name__ in DECODER_LAYERS for layer in layers):
            return None
        norms = [decoder.norm, *(norm for layer in layers for norm in (layer.input_layernorm,
                                                                       layer.post_attention_layernorm))]
        if not all(_is_rms_norm(norm) for norm in norms) or not hasattr(decoder, "rotary_emb"):
            return None
        return cls(decoder, lm_head, model.config.get_text_config())

    @property
    def mixes_prompts(self) -> bool:
        """Whether `step` can take a prompt's tokens beside the decode rows (layers without sliding windows)."""
        return all(window is None for window in self.windows)

    @property
    def prefills_aside(self) -> bool:
        """Whether `prefill` may run in another thread while `step` runs: it takes prompts (`mixes_prompts`), and the
        rotary embedding never changes itself (dynamic and long RoPE scaling rewrite their frequencies as positions
        grow)."""
        rope = getattr(self.decoder.rotary_emb, "rope_type", "default")
        return self.mixes_prompts and not any(kind in str(rope) for kind in ("dynamic", "longrope"))

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, batch: BatchCache, prompts: Sequence[PromptChunk] = ()) -> torch.Tensor:
        """Feed `ids` [rows, 1], one token per row of `batch`, and append their keys and values to it; the logits
        [rows, 1, vocab]. With `prompts` (see `mixes_prompts`), their tokens go through the same forward after the
        rows (vLLM's mixed batch: the decode rows ride along in the prompts' matmuls) and each one's last position's
        logits come after the rows' [rows + prompts, 1, vocab]."""
        mask = batch.mask_with(1)
        logits = self._forward(ids[:, 0], batch.next_positions(), prompts, (batch, mask))
        batch.grew(mask)
        return logits

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[PromptChunk]) -> torch.Tensor:
        """Feed only `prompts` (no decode rows; see `mixes_prompts`): each one's last position's logits
        [prompts, 1, vocab]. Reads no batch, so it may run in another thread while `step` decodes."""
        device = prompts[0].ids.device
        none = torch.empty((0, 1), dtype=torch.long, device=device)
        return self._forward(none[:, 0], none, prompts, None)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, prompts: Sequence[PromptChunk],
                 rows_cache: tuple[BatchCache, torch.Tensor] | None) -> torch.Tensor:
        """The forward of `tokens` (one per decode row of `rows_cache`'s batch, with its mask) and `prompts`."""
        rows = tokens.shape[0]
        if prompts:
            tokens = torch.cat([tokens, *(prompt.ids for prompt in prompts)])
            positions = torch.cat([positions, *(prompt.positions for prompt in prompts)])
        # each prompt's tokens among the step's, after the rows'
        spans = list(itertools.pairwise(itertools.accumulate((len(prompt.ids) for prompt in prompts), initial=rows)))
        hidden = self.decoder.embed_tokens.forward(tokens)  # [rows (+ prompt tokens), hidden]: one position each
        cos, sin = self.decoder.rotary_emb.forward(hidden, positions)  # [rows (+ prompt tokens), 1, head_dim]
        half = self.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # for the halves swapped (`_rope`)
        if rows_cache is not None and not prompts and self.driver is not None:
            batch, mask = rows_cache
            normed = self.driver.run(hidden, cos, sin, _attention_bias(mask, mask.shape[1]), batch)
            if normed is not None:  # the same step, its layers in one C call
                return self.lm_head.forward(normed)[:, None]
        biases: dict[int | None, torch.Tensor] = {}  # by window: the same for every layer of one kind
        width = hidden.shape[0]
        kernel = hidden.dtype == torch.bfloat16 and width <= KERNEL_MAX_ROWS
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        fused = fused_ops.applies(hidden)  # residual adds and norms in one call each (module docstring)
        silu_fused = fused_ops.fuses_silu(hidden)
        combiner = fused_ops.silu_sums() if silu_fused else None
        attention = _rows_attention(hidden, heads // kv_heads, dim)
        sliced = attention is not _grouped_attention  # reading only the cached positions of the room
        table = _prompts_table(prompts, spans, rows, len(self.layers), hidden, heads, kv_heads, dim)
        normed = _add_norm(self.layers[0].input_norm, hidden, None, fused)
        for index, layer in enumerate(self.layers):
            qkv = _projections(layer.attention, QKV, normed, kernel)
            qkv = qkv.view(width, heads + 2 * kv_heads, dim)
            both = qkv if layer.q_norm is None else torch.cat(
                [_rms_norm(layer.q_norm, qkv[:, :heads]), _rms_norm(layer.k_norm, qkv[:, heads: heads + kv_heads])],
                dim=1)
            both = _rope(both, heads + kv_heads, cos, sin, fused)  # [width, heads + kv_heads, head_dim]
            outs = []
            if rows_cache is not None:
                batch, mask = rows_cache
                keys, values = batch.append(index, both[:rows, heads:, None], qkv[:rows, heads + kv_heads:, None])
                if sliced:  # strided keys and values: only the cached positions
                    keys, values = keys[:, :, : mask.shape[1]], values[:, :, : mask.shape[1]]
                window = self.windows[index]
                bias = biases.get(window)
                if bias is None or bias.shape[-1] != keys.shape[2]:
                    bias = biases[window] = _attention_bias(mask, keys.shape[2], window)
                outs.append(attention(both[:rows, :heads].reshape(rows, kv_heads, -1, dim), keys, values, bias,
                                      layer.scaling).view(rows, -1))
            if table is not None:  # every prompt's attention in one call, its keys and values written in place
                outs.append(prompt_attention.prompts_attention(table[index], both, qkv[:, heads + kv_heads:],
                                                               width - rows, layer.scaling))
            else:
                outs += [prompt.attend(index, layer, both[start:end], qkv[start:end, heads + kv_heads:])
                         for prompt, (start, end) in zip(prompts, spans, strict=True)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs)
            normed = _add_norm(layer.post_norm, hidden, _linear(layer.o_proj, out, kernel), fused)
            down = _linear(layer.down_proj, _activated(layer, normed, kernel, silu_fused, combiner), kernel)
            if index + 1 < len(self.layers):
                normed = _add_norm(self.layers[index + 1].input_norm, hidden, down, fused)
            else:
                hidden += down
        for prompt in prompts:
            prompt.grew()
        if prompts:
            hidden = hidden[[*range(rows), *(end - 1 for _, end in spans)]]
        return self.lm_head.forward(_add_norm(self.decoder.norm, hidden, None, fused))[:, None]


class PromptChunk:
    """A prompt's tokens `start` onwards fed beside a decode step (`FastDecode.step`), appended to its own cache
    (`cache`, holding the `start` tokens before them): causal attention over that cache, as a chunked prefill."""

    def __init__(self, ids: list[int], start: int, cache: BatchCache, heads: int) -> None:
        device = cache.mask.device
        self.ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.positions = torch.arange(start, start + len(ids), device=device)[:, None]
        self.cache, self.heads = cache, heads
        self.mask = cache.mask_with(len(ids))  # [1, start + tokens]
        causal = torch.ones((len(ids), self.mask.shape[1]), dtype=torch.bool, device=device).tril(start)
        # transformers' own masks for SDPA: none for a whole prompt (causal), else [1, 1, tokens, start + tokens],
        # so that the prompt's logits are its own prefill's bit for bit (in bf16 on AMX tiles, within a rounding)
        self.allowed = self.mask.bool()[:, None, None, :] & causal if start else None
        self.start, self.causal = start, start == 0 or bool(self.mask.all())  # nothing hidden but the future
        self.kv: torch.Tensor | None = None  # its cache's every layer, written in place (`in_place`)

    def attend(self, index: int, layer: _Layer, rotated: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Layer `index`'s attention output [tokens, heads * head_dim] for the tokens' rotated queries and keys
        `rotated` [tokens, heads + kv_heads, head_dim] and `values` [tokens, kv_heads, head_dim]."""
        heads = self.heads
        keys, values = self.cache.cache.update(rotated[:, heads:].transpose(0, 1)[None],
                                               values.transpose(0, 1)[None], index)
        if (self.causal and keys.is_contiguous() and values.is_contiguous()
                and prompt_attention.attends(rotated, heads, keys.shape[1], keys.shape[3], keys.shape[2])):
            return prompt_attention.prompt_attention(rotated[:, :heads], keys[0], values[0], self.start,
                                                     layer.scaling)
        query = rotated[:, :heads].transpose(0, 1)[None]  # [1, heads, tokens, head_dim]
        out = sdpa_attention_forward(layer.attention, query, keys, values, self.allowed, scaling=layer.scaling)[0]
        return out.reshape(self.ids.shape[0], -1)

    def in_place(self, layers: int, kv_heads: int, head_dim: int, row: int, out_row: int) -> list[list[int]] | None:
        """Room for its cache's keys and values, every layer's in one tensor (`kv`: [layers, 2, kv_heads, start +
        tokens, head_dim], held by the cache once fed), and each layer's row of a `prompts_attention` table (its
        tokens from `row` of the forward's, its output from `out_row`); None when its cached positions are not laid
        out as the kernel reads them (a position every `head_dim`)."""
        positions = self.start + self.ids.shape[0]
        layers_now: list[Any] = list(self.cache.cache.layers) if self.start else []
        cached = [(layer.keys, layer.values) for layer in layers_now]
        if self.start and (len(cached) != layers or not all(
                keys.shape[2] == self.start and keys.stride()[2:] == (head_dim, 1) and keys.stride() == values.stride()
                for keys, values in cached)):
            return None
        self.kv = torch.empty((layers, 2, kv_heads, positions, head_dim), dtype=torch.bfloat16)
        base, half = self.kv.data_ptr(), kv_heads * positions * head_dim * 2  # bytes: one layer's keys or values
        cached_at = [(keys.data_ptr(), values.data_ptr(), keys.stride(1)) for keys, values in cached]
        rows = []
        for layer, (keys_at, values_at, stride) in enumerate(cached_at or [(0, 0, 0)] * layers):
            rows.append([row, self.ids.shape[0], self.start, base + 2 * layer * half, base + (2 * layer + 1) * half,
                         positions * head_dim, keys_at, values_at, stride, out_row])
        return rows

    def grew(self) -> None:
        if self.kv is not None:
            hold(self.cache.cache, self.kv)
            self.kv = None
        self.cache.grew(self.mask)


class _Layer:
    """A decoder layer's modules, looked up once (their tensors are read at every step: a sleep swaps them)."""

    def __init__(self, layer: Any) -> None:
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.attention, self.o_proj, self.scaling = layer.self_attn, layer.self_attn.o_proj, layer.self_attn.scaling
        self.mlp, self.down_proj, self.act = layer.mlp, layer.mlp.down_proj, layer.mlp.act_fn
        self.q_norm, self.k_norm = getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)


def _prompts_table(prompts: Sequence[PromptChunk], spans: list[tuple[int, int]], rows: int, layers: int,
                   hidden: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor | None:
    """Every layer's `prompts_attention` table for `prompts` [layers, prompts, PROMPT_FIELDS] (each prompt's keys
    and values written into a cache tensor of its own: `PromptChunk.in_place`), or None when the kernel does not
    take all of them (then each prompt attends on its own, `PromptChunk.attend`)."""
    if not prompts or not all(prompt.causal and prompt_attention.attends(
            hidden, heads, kv_heads, head_dim, prompt.start + prompt.ids.shape[0]) for prompt in prompts):
        return None
    tables = [prompt.in_place(layers, kv_heads, head_dim, start, start - rows)
              for prompt, (start, _) in zip(prompts, spans, strict=True)]
    if any(table is None for table in tables):
        for prompt in prompts:
            prompt.kv = None
        return None
    return torch.tensor(tables, dtype=torch.int64).transpose(0, 1).contiguous()


def _share(owner: nn.Module, names: tuple[str, ...]) -> None:
    """Give `owner` one shared int8 tensor for its Linears `names` when all are `Int8Linear`s that can share."""
    linears = [getattr(owner, name) for name in names]
    if SHARED_QDATA in owner._buffers or not all(type(linear) is Int8Linear for linear in linears):
        return
    shared = share_storage(linears)
    if shared is not None and shared[0].shape[1] % KERNEL_IN_MULTIPLE == 0:
        owner.register_buffer(SHARED_QDATA, shared[0], persistent=False)
        owner.register_buffer(SHARED_SCALE, shared[1], persistent=False)


def _projections(owner: nn.Module, names: tuple[str, ...], hidden: torch.Tensor, kernel: bool) -> torch.Tensor:
    """The outputs of `owner`'s Linears `names` on `hidden`, side by side: one call where they share a tensor."""
    buffers = owner._buffers
    qdata = buffers.get(SHARED_QDATA)
    if qdata is None:
        fused = fused_pack(owner, names)
        if fused is not None:
            return fused.project(hidden)
        return torch.cat([_linear(getattr(owner, name), hidden, kernel) for name in names], dim=-1)
    scale = buffers[SHARED_SCALE]
    assert scale is not None
    return few_rows_kernel(hidden, qdata, scale) if kernel else int8_matmul(hidden, qdata, scale)


def _linear(module: Any, hidden: torch.Tensor, kernel: bool) -> torch.Tensor:
    """`module` on `hidden`; an `Int8Linear` without bias straight through the int8 kernel when `kernel` (a few bf16
    rows)."""
    if kernel and type(module) is Int8Linear and module.bias is None and module.in_features % KERNEL_IN_MULTIPLE == 0:
        return few_rows_kernel(hidden, module.qdata, module.scale)
    return module.forward(hidden)


def _is_rms_norm(module: nn.Module) -> bool:
    """transformers' Llama-style RMSNorm (weight times the normalised input, no offset)."""
    name = type(module).__name__
    return name.endswith("RMSNorm") and not name.startswith("Gemma") and hasattr(module, "variance_epsilon")


def _rope(x: torch.Tensor, heads: int, cos: torch.Tensor, sin: torch.Tensor, fused: bool) -> torch.Tensor:
    """RoPE on the first `heads` heads of `x` [width, more heads, head_dim], rounded as transformers rounds it (two
    products, then their sum; one addcmul rounds once and can tip a near-tie): a prompt's logits come out as its own
    prefill's, bit for bit, in bf16 too. `sin` has its first half negated, so the halves swapped stand for
    transformers' `rotate_half`."""
    if fused:
        return fused_ops.rope(x, heads, cos, sin)
    x = x[:, :heads]
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _activated(layer: _Layer, normed: torch.Tensor, kernel: bool, fused: bool, combiner: int | None) -> torch.Tensor:
    """`act(gate) * up` of the MLP on `normed`: for SiLU where `fused` (`fuses_silu`), from the tiles' sums
    without writing gate or up where the two share a tile weight without bias (`TileWeight.glu`, `combiner` its
    SiLU), else in one fused call after their matmul."""
    silu = fused and (type(layer.act) is nn.SiLU or type(layer.act).__name__ == "SiLUActivation")  # both `F.silu`
    pack = fused_pack(layer.mlp, GATE_UP) if silu and combiner is not None else None
    if pack is not None and isinstance(pack.packed, TileWeight) and pack.bias is None and pack.packed.halves:
        return pack.packed.glu(normed, combiner)
    gate_up = _projections(layer.mlp, GATE_UP, normed, kernel)
    width = gate_up.shape[-1] // 2
    if silu:
        return fused_ops.silu_mul(gate_up, width)
    gate, up = gate_up.split(width, dim=-1)
    return layer.act(gate).mul_(up)


def _add_norm(norm: Any, hidden: torch.Tensor, addend: torch.Tensor | None, fused: bool) -> torch.Tensor:
    """`hidden += addend` (unless None), then `norm` of `hidden`: in one fused call where `fused` takes it."""
    if fused and norm.weight.dtype == hidden.dtype:
        return fused_ops.add_rms_norm(hidden, addend, norm.weight, norm.variance_epsilon)
    if addend is not None:
        hidden += addend
    return _rms_norm(norm, hidden)


def _rms_norm(norm: Any, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' `LlamaRMSNorm.forward`, operation for operation (`values` is `hidden` itself in float32)."""
    values = hidden.to(torch.float32)
    scale = values.pow(2).mean(-1, keepdim=True).add_(norm.variance_epsilon).rsqrt_()
    return norm.weight * (values * scale).to(hidden.dtype)


def _attention_bias(mask: torch.Tensor, capacity: int, window: int | None = None) -> torch.Tensor:
    """An additive float32 bias [rows, 1, 1, capacity] hiding left padding, the room past the cached positions and,
    for a sliding-window layer, the positions `window` or more before the new one (transformers' sliding mask)."""
    bias = torch.full((mask.shape[0], capacity), float("-inf"), dtype=torch.float32, device=mask.device)
    bias[:, : mask.shape[1]].masked_fill_(mask != 0, 0.0)
    if window is not None:
        bias[:, : max(mask.shape[1] - window, 0)] = float("-inf")
    return bias[:, None, None]


def _rows_attention(hidden: torch.Tensor, group: int, head_dim: int) -> Any:
    """The attention for decode rows of `hidden`'s kind (`group` query heads a KV head of `head_dim`): the fused
    kernel where it takes them, PyTorch's flash SDPA on other CPUs with AMX tiles, else `_grouped_attention`."""
    if decode_attention.attends(hidden, group, head_dim):
        return decode_attention.decode_attention
    return _flash_attention if hidden.device.type == "cpu" and amx_tiles() else _grouped_attention


def _flash_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """`_grouped_attention` through PyTorch's flash SDPA, the KV heads grouped without copies (CPUs with AMX)."""
    rows, kv_heads, group, dim = query.shape
    out = F.scaled_dot_product_attention(query.reshape(rows, kv_heads * group, 1, dim), keys, values,
                                         attn_mask=bias, scale=scaling, enable_gqa=True)
    return out.view(rows, kv_heads, group, dim)


def _grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                       scaling: float) -> torch.Tensor:
    """Attention of one new position per row: `query` [rows, kv_heads, group, dim] over `keys`/`values`
    [rows, kv_heads, capacity, dim], with `bias` hiding what is not attended; the output [rows, kv_heads, group, dim]
    in the query's dtype."""
    dtype = query.dtype
    in_float32 = (dtype == torch.float32 or keys.shape[0] * keys.shape[2] <= FLOAT32_ATTENTION_MAX
                  or (keys.device.type == "cpu" and wide_dtype(dtype) == torch.float32))
    if in_float32 and dtype != torch.float32:
        query, keys, values = query.float(), keys.float(), values.float()
    scores = torch.matmul(query, keys.transpose(-1, -2))
    scores = scores.mul_(scaling) if in_float32 else scores.float().mul_(scaling)
    scores += bias
    weights = scores.softmax(dim=-1)
    out = torch.matmul(weights if in_float32 else weights.to(dtype), values)
    return out if out.dtype == dtype else out.to(dtype)
