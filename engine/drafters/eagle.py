"""EAGLE-1 heads (Li et al. 2024): autoregression over the target's features, one layer deep.

At position i the head reads fc([embed(token_{i+1}); f_i]), where f_i is the target's final hidden
state at i, runs one Llama decoder layer and outputs f_hat_{i+1}; the target's own LM head turns
f_hat_{i+1} into a distribution over token_{i+2}. Drafting continues in feature space: a tree node
with token x below a node whose predicted feature is f_hat reads fc([embed(x); f_hat]).
The target's embedding and LM head are reused, so a head checkpoint holds only fc and the layer.

Checkpoint layout: config.json (a Llama decoder config of the target's width) + model.safetensors
(or pytorch_model.bin, loaded with weights_only=True), keys "fc.*" and "layer.*", and optionally
"draft_vocab" [N] (ours): the token ids the head may draft. Scoring only those rows of the LM head
cuts the cost of each drafted tree level; exactness never depends on it (a draft token outside a
target's favourites is simply rejected, and sampled drafts carry the restricted q they came from).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.decoding.tree import DraftTree, TreeShape
from speclens.engine.drafters.trees import DraftModelTreeDrafter
from speclens.engine.drafters.vocab import draft_vocab_rows, full_vocab_logits
from speclens.engine.runtime.attention import grouped_query_attention
from speclens.engine.runtime.cache import AppendLayer, CachedModel, common_prefix
from speclens.engine.runtime.cpu_kernels import drafter_module
from speclens.engine.runtime.lean_forward import decoder_layers_fit, decoder_weights
from speclens.engine.runtime.masks import ancestor_path, node_depths, tree_attention


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def head_attention(attention, h: torch.Tensor, rotary, like: torch.Tensor, position_ids: torch.Tensor,
                   mask: torch.Tensor, cache: AppendLayer | None, heads: int, kv_heads: int) -> torch.Tensor:
    """A head layer's self-attention: q/k/v of the normed input h [T, W], rotary positions (rotary's
    cos/sin in `like`'s dtype and device), the new keys and values appended to `cache` (if any), grouped
    attention under mask [T, P + T] bool, then o_proj -> [T, H] (EAGLE-1 and EAGLE-3 alike)."""
    n = h.shape[0]
    q = attention.q_proj(h).view(n, heads, -1).transpose(0, 1)  # [heads, T, D]
    k = attention.k_proj(h).view(n, kv_heads, -1).transpose(0, 1)  # [kv heads, T, D]
    v = attention.v_proj(h).view(n, kv_heads, -1).transpose(0, 1)  # [kv heads, T, D]
    cos, sin = rotary(like, position_ids.to(like.device)[None])  # [1, T, D] each
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    k, v = k[None], v[None]  # [1, kv heads, T, D]
    if cache is not None:
        k, v = cache.update(k, v)  # [1, kv heads, P + T, D]
    out = grouped_query_attention(q[None], k, v, mask.to(like.device)[None, None])[0]  # [heads, T, D]
    return attention.o_proj(out.transpose(0, 1).reshape(n, -1))


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"  # LlamaDecoderLayer holds the weights; forward is ours
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)
        self.draft_vocab: torch.Tensor | None = None  # [N] long: token ids the head drafts (None: all)

    @classmethod
    def for_target(cls, target_config) -> EagleHead:
        text = target_config.get_text_config()
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "hidden_act", "vocab_size", "attention_bias", "mlp_bias")
        values = {k: getattr(text, k) for k in keys if getattr(text, k, None) is not None}
        return cls(LlamaConfig(**values))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, cache: AppendLayer | None = None) -> torch.Tensor:
        """embeds, features [T, H]; position_ids [T]; mask [T, P + T] bool (True = may attend), where P
        is the number of entries already in `cache` (0 without one) -> [T, H]. With a cache, the T new
        keys and values are appended to it.

        The decoder layer's math written out (pre-norm attention with rotary positions, then the gated
        MLP) rather than a call to LlamaDecoderLayer.forward: drafting runs this a few times per step on
        a handful of tokens, where HF's general-purpose layer spent more time in Python than in
        arithmetic. test_heads checks it against LlamaDecoderLayer."""
        attention, config = self.layer.self_attn, self.config
        x = self.fc(torch.cat([embeds, features], dim=-1))  # [T, H]
        native = self._native_weights()
        if native is not None:  # on the native kernels: the layer in one native call
            return self._native_layer(native, x, position_ids, mask, cache)
        h = self.layer.input_layernorm(x)
        x = x + head_attention(attention, h, self.rotary, x, position_ids, mask, cache,
                               config.num_attention_heads, config.num_key_value_heads)  # [T, H]
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    def _native_weights(self):
        """What the native `decoder` reads for the layer (engine/runtime/lean_forward.py) if it runs on the native
        kernels, else None. Decided once per set of linears (use_native_linears swaps them), not per pass."""
        q_proj = self.layer.self_attn.q_proj
        memo = getattr(self, "_native", None)
        if memo is None or memo[0] is not q_proj:
            # the native decoder always normalises its input; a public EAGLE-1 head has no input norm
            fits = decoder_layers_fit([self.layer], self.config) and self.has_input_norm
            memo = self._native = (q_proj, decoder_weights([self.layer]) if fits else None)
        return memo[1]

    def _native_layer(self, native, x: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor,
                      cache: AppendLayer | None) -> torch.Tensor:
        """The decoder layer on the native extension's `decoder` (the same math, engine/runtime/lean_forward.py):
        x [T, H] -> [T, H], the new keys and values appended to `cache` (a scratch one if None)."""
        config, attention = self.config, self.layer.self_attn
        weights, columns = native
        cache = AppendLayer() if cache is None else cache
        cos, sin = self.rotary(x, position_ids.to(x.device)[None])  # [1, T, D] each
        cached = cache.get_seq_length()
        end = cached + x.shape[0]
        like = x.new_empty(1, config.num_key_value_heads, 0, attention.head_dim)
        keys, values = cache.reserve(end, like, like)  # [1, kv heads, capacity, D] each
        _, out = attention.q_proj.kernel.decoder(
            x.contiguous(), cos[0].contiguous(), sin[0].contiguous(), weights, [keys[0]], [values[0]], cached,
            mask.to(x.device), None, None, 0, config.num_attention_heads, config.num_key_value_heads, *columns,
            self.layer.input_layernorm.variance_epsilon, attention.scaling, 0, True, attention.q_proj.residual)
        cache.advance(end)
        return out

    @property
    def has_input_norm(self) -> bool:
        return not isinstance(self.layer.input_layernorm, nn.Identity)

    @classmethod
    def load(cls, folder: str | Path) -> EagleHead:
        """A head saved by `save`, or a public EAGLE-1 checkpoint for a Llama-family target (SafeAILab's
        layout: `layers.0.*`, its own copy of `embed_tokens`, which the target's replaces, no input norm
        on that first layer, and an `fc` with or without a bias)."""
        folder = Path(folder)
        head = cls(LlamaConfig(**json.loads((folder / "config.json").read_text())))
        if (folder / "model.safetensors").exists():
            from safetensors.torch import load_file

            state = load_file(folder / "model.safetensors")
        else:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        draft_vocab = state.pop("draft_vocab", None)
        state = {("layer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                 for k, v in state.items() if k != "embed_tokens.weight"}
        if "layer.input_layernorm.weight" not in state:  # EAGLE-1 feeds fc's output to attention as it is
            head.layer.input_layernorm = nn.Identity()
        if "fc.bias" not in state:
            state["fc.bias"] = torch.zeros_like(head.fc.bias)
        head.load_state_dict(state)
        if draft_vocab is not None:
            if draft_vocab.dim() != 1 or not 0 < len(draft_vocab) <= head.config.vocab_size:
                raise ValueError(f"draft_vocab must list 1..{head.config.vocab_size} token ids")
            head.draft_vocab = draft_vocab.long()
        return head.eval()

    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(self.config.to_json_string())
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        if self.draft_vocab is not None:
            state["draft_vocab"] = self.draft_vocab.cpu().contiguous()
        save_file(state, folder / "model.safetensors")


class EagleDrafter(DraftModelTreeDrafter):
    """A token tree from an EAGLE head (dynamic EAGLE-2-style tree, or a static shape).

    Keeps the target's features for the committed positions (the target CachedModel is switched to
    keep_hidden) and a KV cache of the head's decoder layer. Cache entry i holds the head's keys and
    values for the input (f_i, token_{i+1}), so it stays valid while ids[: i + 2] are unchanged; a
    proposal first rolls the cache back to what is still valid (a crop), feeds the committed
    positions it lacks, then feeds each depth's new tree nodes (tree attention over the committed
    entries and their ancestors; position = prefix length + depth), and finally crops the tree off.
    Drafting therefore costs O(new tokens) per step, not O(context).
    """

    def __init__(self, head: EagleHead, target: CachedModel, shape: TreeShape | None = None,
                 top_k: int = 4, budget: int = 16, name: str = "eagle", step_cost: StepCost | None = None):
        super().__init__(target, shape, top_k=top_k, budget=budget, name=name, step_cost=step_cost)
        self.head = drafter_module(head, target.model)
        self.target = target
        self.features: torch.Tensor | None = None  # [n, H] target features of positions 0..n-1
        self.feature_ids: list[int] = []
        self.cache = AppendLayer()  # the head layer's keys and values, [1, kv heads, n, D]
        self.cache_ids: list[int] = []  # ids[: n + 1] for n committed cache entries
        # the token ids the head drafts (None: all), and H -> N: the scores of those tokens
        self._vocab, self._rows = self._scoring(head, target)
        self._f_hat: dict[int, torch.Tensor] = {}  # per proposal: node -> its predicted feature [H]
        self._fed: list[int] = []  # per proposal: tree nodes in the cache, in cache order after the committed
        target.keep_hidden = True

    def _scoring(self, head: nn.Module, target: CachedModel) -> tuple[torch.Tensor | None, nn.Module]:
        """(the token ids [N] the head drafts, None for all; features [n, H] -> their logits [n, N]): the
        target's LM head rows, as EAGLE-1 reuses it."""
        return draft_vocab_rows(target, head.draft_vocab)

    def _target_features(self, start: int, end: int) -> torch.Tensor | None:
        """The target features the head reads at positions start..end-1 (its final hidden states)."""
        return self.target.hidden_at(start, end)

    def prefill(self, ids: list[int]) -> None:
        if len(ids) >= 3:  # the last committed entry is left for the first proposal, which needs its output
            self._feed_committed(ids[:-1], self._sync(ids))

    def commit(self, ids: list[int]) -> None:
        """Keep the target features of the accepted tokens while the verifying forward still holds them (a
        step may not ask the head for a tree: LookupGraftedDrafter); the head cache catches up at the
        next proposal."""
        if len(ids) >= 2:
            self._sync(ids)

    def _sync(self, ids: list[int]) -> torch.Tensor:
        """Target features [len(ids) - 1, H] of positions 0..len(ids)-2 (what the target caches)."""
        want = ids[:-1]
        have = common_prefix(self.feature_ids, want)
        if have == len(want) and self.features is not None:
            return self.features[:have]
        fresh = self._target_features(have, len(want))
        if fresh is None or self.target.cached_ids[: len(want)] != want:
            # the target's latest forward did not cover the gap: re-feed it (the cache stays ids[:-1])
            self.target.truncate(min(have, self.target.common_prefix(want)))
            self.target.prefill([*want, want[-1]])  # in chunks (bounded memory), keeping every chunk's features
            fresh = self._target_features(have, len(want))
        kept = self.features[:have] if self.features is not None else fresh[:0]
        self.features = torch.cat([kept, fresh])  # [len(want), H]
        self.feature_ids = list(want)
        return self.features

    @torch.inference_mode()
    def _feed_committed(self, ids: list[int], features: torch.Tensor) -> torch.Tensor:
        """Make the cache hold the committed entries 0..len(ids)-2 (features [>= len(ids) - 1, H]),
        feeding at least the last one; returns the head outputs [fed, H] of the fed entries."""
        n = len(ids) - 1  # entries wanted
        valid = min(max(common_prefix(self.cache_ids, ids) - 1, 0), n - 1)
        self._crop(valid)
        device = self.target.device
        embeds = self.target.model.get_input_embeddings()(torch.tensor(ids[valid + 1 :], device=device))  # [n - valid, H]
        mask = torch.ones(n - valid, n, dtype=torch.bool).tril(valid)  # [new, cached + new], causal
        out = self.head(embeds, features[valid:n].to(embeds.dtype), torch.arange(valid, n), mask, self.cache)
        self.cache_ids = list(ids)
        return out  # [n - valid, H]

    def _crop(self, n: int) -> None:
        """Keep the first n entries of the head's cache."""
        drop = self.cache.get_seq_length() - n
        if drop > 0:
            self.cache.crop(-drop)

    def propose_tree(self, ids: list[int], depth: int, params: SamplingParams,
                     generator: torch.Generator | None) -> DraftTree:
        if len(ids) < 2:  # no target feature yet: propose the root alone (a plain step)
            return DraftTree(torch.tensor(ids[-1:], device=self.target.device), (-1,), None)
        features = self._sync(ids)
        self._f_hat = {0: self._feed_committed(ids, features)[-1]}  # the root's: f_hat_{L-1}
        self._fed = []
        try:
            return super().propose_tree(ids, depth, params, generator)
        finally:
            self._crop(len(ids) - 1)  # drop the tree: committed entries only

    @torch.inference_mode()
    def _draft_scores(self, ids: list[int], tokens: list[int], parents: list[int], nodes: list[int],
                      params: SamplingParams) -> torch.Tensor:
        """Processed head logits [len(nodes), V] at the given tree nodes (root = the context's end)."""
        self._feed_tree(ids, tokens, parents, nodes)
        logits = self._logits(torch.stack([self._f_hat[m] for m in nodes]))  # [len(nodes), V]
        if params.repetition_penalty == 1.0:  # no history-dependent processing: one batched call
            history = torch.tensor(ids, device=logits.device)
            return process_logits(logits, params, history, history[:0])  # the block only matters to the penalty
        empty = torch.zeros(0, dtype=torch.long, device=logits.device)
        rows = []
        for i, node in enumerate(nodes):
            history = torch.tensor(ids + [tokens[m] for m in ancestor_path(parents, node)], device=logits.device)
            rows.append(process_logits(logits[i : i + 1], params, history, empty)[0])
        return torch.stack(rows)  # [len(nodes), V]

    @torch.inference_mode()
    def _top_candidates(self, ids: list[int], tokens: list[int], parents: list[int], nodes: list[int],
                        params: SamplingParams) -> list[list[tuple[float, int]]]:
        """As the base class, but within the draft vocabulary when no repetition penalty reads the history:
        processing the draft vocabulary's logits alone gives the same distribution as processing the full
        row with -inf elsewhere, without building and normalising that row."""
        if self._vocab is None or params.repetition_penalty != 1.0:
            return super()._top_candidates(ids, tokens, parents, nodes, params)
        self._feed_tree(ids, tokens, parents, nodes)
        logits = self._rows(torch.stack([self._f_hat[m] for m in nodes])).float()  # [len(nodes), N]
        empty = torch.zeros(0, dtype=torch.long, device=logits.device)
        q = process_logits(logits, params, empty, empty).softmax(-1)  # [len(nodes), N]
        top = q.topk(min(self.top_k, q.shape[-1]), dim=-1)
        draft_ids = self._vocab[top.indices].tolist()  # [len(nodes), top_k] token ids
        return [[(p, t) for p, t in zip(probs, row) if p > 0] for probs, row in zip(top.values.tolist(), draft_ids)]

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        """Float logits [n, V] of predicted features [n, H]; outside the draft vocabulary -inf."""
        return full_vocab_logits(self._rows(features), self._vocab, self.target.n_vocab)

    def _feed_tree(self, ids: list[int], tokens: list[int], parents: list[int], nodes: list[int]) -> None:
        """Feed those of `nodes` not fed yet (each a child of a fed node: the tree grows from expanded
        nodes), memoising their predicted features; each attends to the committed entries, its fed
        ancestors and itself. Only the nodes being expanded are fed, as in EAGLE-2: the other drafted
        candidates never need a feature."""
        new = [n for n in nodes if n not in self._f_hat]
        if not new:
            return
        device = self.target.device
        n_ctx, fed = len(ids) - 1, self._fed + new  # fed: tree nodes in cache order after this step
        ancestors = tree_attention(parents)  # [N, N]
        mask = torch.ones(len(new), n_ctx + len(fed), dtype=torch.bool)  # [new, committed + fed]
        mask[:, n_ctx:] = ancestors[torch.tensor(new)][:, torch.tensor(fed)]
        depths = node_depths(parents)
        embeds = self.target.model.get_input_embeddings()(torch.tensor([tokens[n] for n in new], device=device))
        features = torch.stack([self._f_hat[parents[n]] for n in new])  # [new, H]
        positions = torch.tensor([n_ctx - 1 + depths[n] for n in new])  # [new]
        out = self.head(embeds, features, positions, mask, self.cache)  # [new, H]
        for row, node in enumerate(new):
            self._f_hat[node] = out[row]
        self._fed = fed
