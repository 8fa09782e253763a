"""A lean forward pass for Llama-family models on SpecLens's native CPU kernels.

On two CPU cores, HF's forward of the default model spent about 8 of its 26 ms per token outside the
linear and attention kernels: module calls, output recording, mask preparation, the attention
interface, and some thirty small tensor ops per layer, each a trip through Python and the dispatcher.
Here the whole decoder stack is one call into the native extension (`decoder` in
engine/runtime/native_kernels.cpp): HF's LlamaDecoderLayer math (RMSNorm, rotary positions, grouped-query
attention over the KV cache, the gated SiLU MLP), then the final norm and the LM head, with q/k/v and
gate/up each one product over stacked panels. Its elementwise steps work row by row in a fixed order,
so the forward stays batch invariant: a verified block or tree scores each token bit for bit as
one-token decoding does (tests/test_native_kernels.py, tests/test_lean_forward.py). Against HF's
forward on the same kernels it differs by float32 rounding only.

`CachedModel` uses it for plain decoding, verification and trees alike where `lean_forward_for`
accepts the model; anything else (other architectures, biases, other activations, other kernels,
GPUs) keeps HF's forward.
"""

from __future__ import annotations

import torch
from torch import nn

from speclens.engine.runtime.attention import is_native_attention
from speclens.engine.runtime.native_kernels import NativeLinear

# weight formats that give a target's exact float32 outputs: float32 panels, 4-bit and 8-bit blocks
EXACT_FORMATS = (torch.float32, torch.uint8, torch.int8)


class LeanLlamaForward:
    """Logits (and final hidden states) of a LlamaForCausalLM whose linears are all NativeLinear without
    bias and whose attention is the native kernel, with the KV cache of engine.cache (AppendLayer)."""

    def __init__(self, model: nn.Module):
        config = model.config
        self.model = model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.kernel = model.lm_head.kernel  # the native extension every linear runs on
        inner = model.model
        self.embed, self.norm, self.rotary = inner.embed_tokens, inner.norm, inner.rotary_emb
        layers = list(inner.layers[: config.num_hidden_layers])
        self.scale = layers[0].self_attn.scaling
        self.eps = layers[0].input_layernorm.variance_epsilon
        self.weights, self.columns = decoder_weights(layers)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # rotary cos, sin [n, D] (rotations)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor | None,
                 cache, n_logits: int, keep_hidden: bool,
                 features: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids [T]; allowed [T, S] bool (the keys each new token may see, S = cached +
        T) or None for causal; cache: an engine.cache cache whose layers are AppendLayers.
        Returns logits [n_logits, V] of the last rows and, if keep_hidden, final hidden states [T, H], then
        those of the `features` layers (HF's hidden_states indices: j the output of layer j - 1, the last
        index the final normed states), [T, (1 + n) H]. Features cut the stack into one native call per
        stretch of layers between them; each layer's math is the same, so the logits do not change."""
        with torch.inference_mode():
            x = self.embed(input_ids)  # [T, H]
            cos, sin = self.rotations(x, position_ids)  # [T, D] each
            layers = cache.layers
            cached = layers[0].get_seq_length()
            end = cached + input_ids.shape[0]
            like = x.new_empty(1, self.kv_heads, 0, self.head_dim)
            for layer in layers:
                layer.reserve(end, like, like)  # [1, kv heads, capacity, D] each
            top = len(layers)
            states = {0: x}
            start = 0
            for cut in sorted({j for j in features if 0 < j < top}) + [top]:
                last = cut == top
                logits, hidden = self.kernel.decoder(
                    x, cos, sin, self.weights[6 * start : 6 * cut], [layer.planes[0] for layer in layers[start:cut]],
                    [layer.planes[1] for layer in layers[start:cut]], cached, allowed,
                    self.norm.weight.detach() if last else None, self.model.lm_head.panels if last else None,
                    self.model.lm_head.out_features, self.heads, self.kv_heads, *self.columns, self.eps, self.scale,
                    n_logits if last else 0, keep_hidden or not last, self.model.lm_head.residual)
                if not last:
                    x = states[cut] = hidden  # [T, H]: the residual stream after layer cut - 1
                start = cut
            for layer in layers:
                layer.advance(end)
        if not keep_hidden:
            return logits, None
        states[top] = hidden
        return logits, torch.cat([hidden, *(states[j] for j in features)], dim=-1) if features else hidden

    def move_rows(self, buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """Copy cache rows src -> dst (ascending, towards the start) in every buffer [1, KV, capacity, D]."""
        self.kernel.move_rows(buffers, src, dst)

    def rotations(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] of the rotary embedding at position_ids [T]: rows of a table HF's rotary module
        made for positions 0 .. n - 1 (grown by doubling), where calling the module each step took 0.1 ms.
        A row is the same whichever step reads it, so a verified block still matches decoding bit for bit."""
        top = int(position_ids.max()) + 1
        if self._table is None or top > self._table[0].shape[0]:
            n = max(256, 2 * top)
            cos, sin = self.rotary(x, torch.arange(n)[None])  # [1, n, D] each
            self._table = (cos[0].contiguous(), sin[0].contiguous())
        return self._table[0][position_ids], self._table[1][position_ids]


def decoder_weights(layers) -> tuple[list[torch.Tensor], tuple[int, int, int, int]]:
    """What the extension's `decoder` reads for HF Llama decoder layers on native linears: six tensors per
    layer (input norm, stacked q/k/v panels, o panels, post-attention norm, stacked gate/up panels, down
    panels) and the columns (k at, v at, intermediate size, up at) of the stacked products."""
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv, k_at, v_at = _stack(attn.q_proj, attn.k_proj, attn.v_proj)
        gate_up, up_at = _stack(mlp.gate_proj, mlp.up_proj)
        weights += [layer.input_layernorm.weight.detach(), qkv, attn.o_proj.panels,
                    layer.post_attention_layernorm.weight.detach(), gate_up, mlp.down_proj.panels]
    return weights, (k_at, v_at, layers[0].mlp.gate_proj.out_features, up_at)


def decoder_layers_fit(layers, config) -> bool:
    """Whether `decoder` can run these HF Llama decoder layers: every linear native and without bias, SiLU."""
    linears = [getattr(layer.self_attn, name) for layer in layers for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    linears += [getattr(layer.mlp, name) for layer in layers for name in ("gate_proj", "up_proj", "down_proj")]
    stacked = [(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in layers]
    stacked += [(layer.mlp.gate_proj, layer.mlp.up_proj) for layer in layers]
    return (config.hidden_act == "silu" and getattr(config, "pretraining_tp", 1) == 1
            and all(type(linear) is NativeLinear and linear.bias is None and hasattr(linear.kernel, "decoder")
                    for linear in linears)
            # one activation precision for the whole stack (the decoder takes one)
            and len({linear.residual for linear in linears}) == 1
            # a stacked product reads one format (float32, bfloat16, 4-bit or 8-bit blocks, float or integer) for all its linears
            and all(len({(linear.panels.dtype, linear.panels.shape[1:]) for linear in group}) == 1 for group in stacked))


def _stack(*linears: NativeLinear) -> tuple[torch.Tensor, ...]:
    """The panels of linears over one input stacked into one product, and the first column of each
    linear after the first (panels pad to 64 columns). Each linear's panels become a view of the stack,
    so the weights are not held twice."""
    panels = torch.cat([linear.panels for linear in linears])  # [P, ...]: 16 output columns a panel
    starts, start = [], 0
    for linear in linears:
        count = linear.panels.shape[0]
        linear.panels = panels[start : start + count]
        starts.append(start * 16)
        start += count
    return (panels, *starts[1:])


def lean_forward_for(model: nn.Module) -> LeanLlamaForward | None:
    """The lean forward for a float32 Llama model on the native kernels (linears without bias, attention,
    a SiLU MLP), else None. Built once per model: every CachedModel of it shares it."""
    lean = getattr(model, "_speclens_lean_forward", None)
    if lean is not None:
        return lean
    config = model.config
    if type(model).__name__ != "LlamaForCausalLM" or config.model_type != "llama" or not is_native_attention(model):
        return None
    inner = model.model
    layers = list(inner.layers[: config.num_hidden_layers])
    head = model.lm_head
    if (type(head) is not NativeLinear or head.bias is not None or type(inner.embed_tokens) is not nn.Embedding
            or not decoder_layers_fit(layers, config) or layers[0].self_attn.q_proj.residual != head.residual
            or head.panels.dtype not in EXACT_FORMATS
            or any(layer.self_attn.q_proj.panels.dtype not in EXACT_FORMATS for layer in layers)):
        return None
    lean = LeanLlamaForward(model)
    model._speclens_lean_forward = lean
    return lean
