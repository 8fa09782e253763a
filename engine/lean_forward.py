"""A lean forward pass for Llama-family models on SpecLens's native CPU kernels.

On two CPU cores, plain decoding of the default model spent about 8 of its 26 ms per token in HF's
Python: module calls, output recording, mask preparation, the attention interface. This is the same
decoder math, op for op (RMSNorm, rotary positions, grouped-query attention, the gated MLP), written
as one loop that calls the native linear and attention kernels directly. Every op sees the same
values as in HF's forward, so the logits and hidden states are bit for bit HF's on the same kernels
(tests/test_lean_forward.py checks this), and the forward stays batch invariant.

`CachedModel` uses it for plain decoding, verification and trees alike where `lean_forward_for`
accepts the model; anything else (other architectures, other kernels, GPUs) keeps HF's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention import is_native_attention
from engine.native_kernels import NativeLinear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LeanLlamaForward:
    """Logits (and final hidden states) of a LlamaForCausalLM whose linears are all NativeLinear and
    whose attention is the native kernel, with the KV cache of engine.cache (HF cache layers)."""

    def __init__(self, model: nn.Module):
        self.model = model
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.kernel = model.lm_head.kernel  # the native extension every linear runs on
        inner = model.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        self.layers = list(inner.layers[: config.num_hidden_layers])
        self.scale = self.layers[0].self_attn.scaling
        # per layer, q/k/v and gate/up each as one product: fewer kernel calls, and the small k and v
        # projections no longer leave a thread idle. Each output is still its own FMA chain.
        self.qkv = [_fuse(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in self.layers]
        self.gate_up = [_fuse(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in self.layers]

    def _linear(self, layer: NativeLinear, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.kernel.linear(x, layer.panels, layer.bias, layer.out_features)

    @staticmethod
    def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:  # HF's LlamaRMSNorm for float32
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor | None,
                 cache, n_logits: int, keep_hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids [T]; allowed [T, S] bool (the keys each new token may see, S = cached +
        T) or None for causal; cache: an engine.cache cache whose layers append the new keys and values.
        Returns logits [n_logits, V] of the last rows and, if keep_hidden, final hidden states [T, H]."""
        n = input_ids.shape[0]
        x = self.embed(input_ids)  # [T, H]
        cos, sin = self.rotary(x, position_ids[None])  # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]: every head alike
        attention = self.kernel.attention
        for layer, qkv, gate_up, cache_layer in zip(self.layers, self.qkv, self.gate_up, cache.layers):
            q, k, v = qkv(self.kernel, self._rms_norm(layer.input_layernorm, x))  # [T, q / k / v width]
            q = q.view(n, self.heads, self.head_dim)  # [T, heads, D]
            k, v = k.view(n, self.kv_heads, self.head_dim), v.view(n, self.kv_heads, self.head_dim)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            keys, values = cache_layer.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])  # [1, kv heads, S, D]
            out = attention(q, keys[0], values[0], allowed, self.scale, True)  # [T, heads, D]
            x = x + self._linear(layer.self_attn.o_proj, out.view(n, -1))
            gate, up = gate_up(self.kernel, self._rms_norm(layer.post_attention_layernorm, x))
            x = x + self._linear(layer.mlp.down_proj, layer.mlp.act_fn(gate) * up)
        if keep_hidden:
            hidden = self._rms_norm(self.norm, x)  # [T, H]
            return self._linear(self.model.lm_head, hidden[-n_logits:]), hidden
        return self._linear(self.model.lm_head, self._rms_norm(self.norm, x[-n_logits:])), None


class _Fused:
    """Linears that read the same input as one product over their stacked panels."""

    def __init__(self, panels: torch.Tensor, bias: torch.Tensor | None, parts: list[tuple[int, int]]):
        self.panels, self.bias, self.parts = panels, bias, parts  # parts: (first column, width) of each linear

    def __call__(self, kernel, x: torch.Tensor) -> list[torch.Tensor]:  # [T, in] -> a [T, width] view per linear
        y = kernel.linear(x, self.panels, self.bias, self.panels.shape[0] * self.panels.shape[2])
        return [y[:, start : start + width] for start, width in self.parts]


def _fuse(*linears: NativeLinear) -> _Fused:
    """Stack the panels of linears over one input; each linear's panels become a view of the stack (no second
    copy). A linear's columns start where the previous one's panels end (panels pad to 64 columns)."""
    panels = torch.cat([linear.panels for linear in linears])  # [P, in, 16]
    parts, start, biases = [], 0, []
    for linear in linears:
        columns = linear.panels.shape[0] * linear.panels.shape[2]
        linear.panels = panels[start // 16 : (start + columns) // 16]
        parts.append((start, linear.out_features))
        bias = torch.zeros(columns)
        if linear.bias is not None:
            bias[: linear.out_features] = linear.bias
        biases.append(bias)
        start += columns
    any_bias = any(linear.bias is not None for linear in linears)
    return _Fused(panels, torch.cat(biases) if any_bias else None, parts)


def lean_forward_for(model: nn.Module) -> LeanLlamaForward | None:
    """The lean forward for a float32 Llama model on the native kernels (linears and attention), else None."""
    config = model.config
    if type(model).__name__ != "LlamaForCausalLM" or config.model_type != "llama" or not is_native_attention(model):
        return None
    inner = model.model
    layers = list(inner.layers[: config.num_hidden_layers])
    linears = [model.lm_head] + [getattr(layer.self_attn, name) for layer in layers
                                 for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(layer.mlp, name) for layer in layers for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(linear) is NativeLinear and linear.panels.dtype == torch.float32 for linear in linears):
        return None
    if getattr(config, "pretraining_tp", 1) != 1 or type(inner.embed_tokens) is not nn.Embedding:
        return None
    if any(layer.self_attn.num_key_value_groups * config.num_key_value_heads != config.num_attention_heads
           for layer in layers):
        return None
    lean = getattr(model, "_speclens_lean_forward", None)
    if lean is None:  # built once per model: every CachedModel of it shares the stacked panels
        lean = LeanLlamaForward(model)
        model._speclens_lean_forward = lean
    return lean
