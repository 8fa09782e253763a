"""The static-cache forward for Llama-family targets in PyTorch, captured as CUDA graphs on a GPU.

HF's eager forward of a small model on a GPU is bound by kernel launches, not by the GPU: about 1 ms
per layer of Python, module calls and mask building, so a 135M model costs as much per step as an 8B
one. This forward is the gpt-fast recipe on the model HF loaded (its own weights and modules, nothing
copied): keys and values go into the preallocated buffers of the cache's AppendLayers at explicit
slots (engine/runtime/cache.py: rollback is a move of each layer's length), attention reads the
buffers in place under an explicit mask, and nothing in a step depends on Python state but its
inputs. So on CUDA each step shape is captured once as a `torch.cuda.CUDAGraph` per cache and
replayed: one launch for the whole stack. Shapes are padded to a few sizes (1, 2, 4, ... 64 tokens),
so a plain step, a chain of K + 1 and a tree padded to its budget each replay one graph; bigger
blocks (prefill chunks) run eagerly, where launch overhead is small next to the work.

On a CPU the same code runs eagerly over just the slots held (no capture), on whatever linear
modules the model has (stock, oneDNN-packed, native), so CI tests it; the native lean forward
(engine/runtime/lean_forward.py) stays first where it fits. The families: Llama 2/3 (SmolLM),
Mistral (its sliding window in the mask), Qwen2 (q/k/v biases), Qwen3 (q/k norms). Anything else,
and models spread over devices by accelerate, keep HF's forward; `static_forward_for` says why.

Numbers: the norms, linears, activation and RoPE are HF's own modules and formula; attention is SDPA
with the query heads of a group stacked (engine/runtime/attention.py), as HF's SDPA path computes it.
Logits equal HF's forward within float rounding (tests/test_static_forward.py: 1e-5 in float32).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from speclens.engine.runtime.attention import grouped_query_attention

FAMILIES = {  # HF class -> model_type
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # step shapes captured on CUDA; a step pads to the next one
GPU_CAPACITY = 2048  # slots reserved up front on CUDA (doubled when a context outgrows them)


def graphs_enabled(device: torch.device) -> bool:
    """CUDA graphs on a CUDA device unless SPECLENS_CUDA_GRAPHS=0 (to measure or debug the eager path)."""
    return device.type == "cuda" and os.environ.get("SPECLENS_CUDA_GRAPHS", "1") != "0"


@dataclass
class _Graph:
    """One captured step of `size` tokens over a cache of `capacity` slots: static inputs, outputs."""

    size: int
    capacity: int
    features: tuple[int, ...]  # the layers whose hidden states it returns too
    ids: torch.Tensor  # [size] long
    positions: torch.Tensor  # [size] long
    slots: torch.Tensor  # [size] long: where each row's key and value are written
    allowed: torch.Tensor  # [size, capacity] bool
    graph: object = None
    logits: torch.Tensor | None = None  # [size, V]
    hidden: torch.Tensor | None = None  # [size, H]
    keep: tuple = field(default_factory=tuple)  # tensors the graph reads that nothing else holds


class StaticLlamaForward:
    """Logits and final hidden states of a Llama-family HF model over an engine.cache cache whose layers
    are AppendLayers; same call as LeanLlamaForward, so CachedModel runs either."""

    def __init__(self, model: nn.Module):
        config = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        inner = model.model
        self.embed, self.norm, self.rotary, self.head = inner.embed_tokens, inner.norm, inner.rotary_emb, model.lm_head
        self.layers = list(inner.layers[: config.num_hidden_layers])
        self.windows = [layer_window(model, layer) for layer in self.layers]  # None: full attention
        self.graphs = graphs_enabled(self.device)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # rotary cos, sin [n, D]
        self._capturing = False  # inside a graph capture: no host reads, no table growth
        self._pool = None  # one CUDA memory pool for every graph of this model

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor | None,
                 cache, n_logits: int, keep_hidden: bool,
                 features: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids [T] (on the CPU); allowed [T, S] bool (S = cached + T) or None for causal.
        Returns logits [n_logits, V] of the last rows and, if keep_hidden, hidden states [T, H]: the final
        ones, then those of the `features` layers (HF's hidden_states indices), [T, (1 + n) H]."""
        with torch.inference_mode():
            layers = cache.layers
            cached, t = layers[0].get_seq_length(), input_ids.shape[0]
            end = cached + t
            if allowed is None:
                allowed = torch.ones(t, end, dtype=torch.bool).tril(cached)
            size = next((s for s in GRAPH_SIZES if s >= t), None)
            if self.graphs and size is not None:
                logits, hidden = self._replay(cache, input_ids, position_ids, allowed, size, features)
                logits, hidden = logits[t - n_logits : t].clone(), hidden[:t].clone() if keep_hidden else None
            else:
                self._reserve(cache, end)
                slots = torch.arange(cached, end)
                ids, positions, slots, allowed = (tensor.to(self.device) for tensor in (input_ids, position_ids, slots,
                                                                                           allowed))
                logits, hidden = self.step(ids, positions, slots, allowed, [layer.buffers for layer in layers], end,
                                           n_logits, features)
            for layer in layers:
                layer.advance(end)
        return logits, hidden if keep_hidden else None

    def step(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, allowed: torch.Tensor,
             buffers: list, span: int, n_logits: int, features: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
        """The decoder stack on ids, positions, slots [T] (device tensors), reading the first `span` slots
        of each layer's buffers (keys, values [1, KV, capacity, D]) under allowed [T, span]: writes the
        new keys and values at `slots`, returns logits [n_logits, V] and hidden states [T, (1 + n) H] (the
        final ones, then the input of each layer in `features`, the final ones again for the last index).
        Nothing here depends on Python state but the shapes, so it can be captured as a graph."""
        t = ids.shape[0]
        x = self.embed(ids)[None]  # [1, T, H]
        cos, sin = self._rotations(x, positions)  # [T, 1, D] each
        masks = {window: self._window_mask(allowed, positions, window, span) for window in set(self.windows)}
        states = {}  # HF's hidden_states index -> [T, H]: the input of that layer
        for index, (layer, (keys, values), window) in enumerate(zip(self.layers, buffers, self.windows)):
            if index in features:
                states[index] = x[0]
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(t, self.heads, self.head_dim)  # [T, H, D]
            k = attn.k_proj(h).view(t, self.kv_heads, self.head_dim)  # [T, KV, D]
            v = attn.v_proj(h).view(t, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            keys.index_copy_(2, slots, k.transpose(0, 1)[None])  # [1, KV, T, D] into [1, KV, capacity, D]
            values.index_copy_(2, slots, v.transpose(0, 1)[None])
            out = grouped_query_attention(q.transpose(0, 1)[None], keys[:, :, :span], values[:, :, :span],
                                          masks[window], attn.scaling)  # [1, H, T, D]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(1, t, self.heads * self.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = self.norm(x)[0]  # [T, H]
        logits = self.head(hidden[t - n_logits :])
        if features:
            hidden = torch.cat([hidden, *(states.get(j, hidden) for j in features)], dim=-1)
        return logits, hidden

    def move_rows(self, buffers: list[torch.Tensor], src: list[int], dst: list[int]) -> None:
        """Copy cache rows src -> dst (ascending, towards the start) in every buffer [1, KV, capacity, D]."""
        src_t, dst_t = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for buffer in buffers:
            buffer[:, :, dst_t] = buffer[:, :, src_t]

    # --- CUDA graphs ------------------------------------------------------------------------

    def _replay(self, cache, input_ids, position_ids, allowed, size: int,
                features: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Run a step of T <= size tokens as the graph of `size` captured for this cache (captured now if
        new). Padding rows write past the tokens held (slots later steps overwrite) and see only
        themselves; no real row sees them."""
        layers = cache.layers
        cached, t = layers[0].get_seq_length(), input_ids.shape[0]
        self._reserve(cache, cached + size)
        capacity = layers[0].buffers[0].shape[-2]
        graphs = cache.__dict__.setdefault("speclens_graphs", {})  # the graphs bind this cache's buffers
        graph = graphs.get((size, capacity, features))
        if graph is None:
            if any(c != capacity for _, c, _ in graphs):  # the cache grew: graphs of its old buffers are stale
                graphs.clear()
            graph = graphs[(size, capacity, features)] = _Graph(
                size, capacity, features, torch.zeros(size, dtype=torch.long, device=self.device),
                torch.zeros(size, dtype=torch.long, device=self.device),
                torch.zeros(size, dtype=torch.long, device=self.device),
                torch.zeros(size, capacity, dtype=torch.bool, device=self.device))
        pad = size - t
        rows = torch.stack([torch.cat([input_ids, input_ids.new_zeros(pad)]),  # [3, size]: ids, positions, slots
                            torch.cat([position_ids, position_ids[-1:].expand(pad)]),
                            torch.arange(cached, cached + size)])
        for buffer, row in zip((graph.ids, graph.positions, graph.slots), rows.to(self.device)):
            buffer.copy_(row)
        mask = torch.zeros(size, capacity, dtype=torch.bool)
        mask[:t, : allowed.shape[1]] = allowed
        mask[torch.arange(t, size), torch.arange(cached + t, cached + size)] = True  # padding sees itself
        graph.allowed.copy_(mask)
        if graph.graph is None:
            self._capture(graph, [layer.buffers for layer in layers])
        graph.graph.replay()
        return graph.logits, graph.hidden

    def _capture(self, graph: _Graph, buffers: list) -> None:
        """Capture the step of `graph`'s shape over these buffers (the rotary table grown first to cover
        every slot, since a captured step cannot grow it)."""
        self._rotations(self.embed.weight[:1][None], torch.tensor([graph.capacity - 1], device=self.device))
        if self._pool is None and self.device.type == "cuda":
            self._pool = torch.cuda.graph_pool_handle()
        self._capturing = True
        try:
            graph.graph, (graph.logits, graph.hidden) = capture_graph(
                lambda: self.step(graph.ids, graph.positions, graph.slots, graph.allowed, buffers, graph.capacity,
                                  graph.size, graph.features), self.device, self._pool)
        finally:
            self._capturing = False
        graph.keep = self._table  # the rotary table this graph gathers from

    # --- pieces ---------------------------------------------------------------------------

    def _reserve(self, cache, end: int) -> None:
        """Every layer's buffers hold at least `end` slots (GPU_CAPACITY up front on CUDA)."""
        like = torch.empty(1, self.kv_heads, 0, self.head_dim, device=self.device, dtype=self.dtype)
        want = max(end, GPU_CAPACITY) if self.device.type == "cuda" else end
        for layer in cache.layers:
            layer.reserve(want, like, like)

    def _rotations(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] at positions [T]: rows of a table HF's rotary module made (grown by doubling
        outside a capture; a captured step's positions stay inside the table it was captured with)."""
        if not self._capturing:
            top = int(positions.max()) + 1
            if self._table is None or top > self._table[0].shape[0]:
                n = max(256, 2 * top)
                cos, sin = self.rotary(x, torch.arange(n, device=self.device)[None])  # [1, n, D] each
                self._table = (cos[0].contiguous(), sin[0].contiguous())
        return self._table[0][positions][:, None], self._table[1][positions][:, None]

    def _window_mask(self, allowed: torch.Tensor, positions: torch.Tensor, window: int | None,
                     span: int) -> torch.Tensor:
        """[1, 1, T, span] bool: allowed, and for a sliding-window layer only the keys within `window` of
        the query's position (HF's rule kv > q - window; context slots are positions)."""
        if window is None:
            return allowed[None, None]
        near = torch.arange(span, device=allowed.device)[None] > positions[:, None] - window
        return (allowed & near)[None, None]


def capture_graph(run, device: torch.device, pool) -> tuple[object, tuple[torch.Tensor, ...]]:
    """Capture run() as a CUDA graph after a warm-up on a side stream (as torch requires); returns the
    graph and its output tensors, which each replay() refills. The warm-up writes the same keys and
    values the step will."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph, outputs


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def layer_window(model: nn.Module, layer: nn.Module) -> int | None:
    """The sliding window of a decoder layer's attention (None: full attention)."""
    if model.config.model_type == "mistral":
        return getattr(model.config, "sliding_window", None)
    return getattr(layer.self_attn, "sliding_window", None)


def why_not_static(model: nn.Module) -> str | None:
    """Why the static-cache forward cannot run this model (a sentence), or None if it can."""
    name = type(model).__name__
    config = model.config
    if FAMILIES.get(name) != getattr(config, "model_type", None):
        return f"it knows the Llama, Mistral, Qwen2 and Qwen3 families, not {name}"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "the model is spread over several devices (offload)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(inner, "layers"):
        return "the model has no rotary embedding or decoder layers where HF's Llama has them"
    if type(inner.embed_tokens) is not nn.Embedding:
        return "its input embedding is not a plain embedding"
    return None


def static_forward_for(model: nn.Module) -> StaticLlamaForward | None:
    """The static-cache forward for a Llama-family model, built once per model (None: see why_not_static)."""
    forward = getattr(model, "_speclens_static_forward", None)
    if forward is None and why_not_static(model) is None:
        forward = StaticLlamaForward(model)
        model._speclens_static_forward = forward
    return forward
