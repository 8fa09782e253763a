"""EAGLE-1 heads (Li et al. 2024): autoregression over the target's features, one layer deep.

At position i the head reads fc([embed(token_{i+1}); f_i]), where f_i is the target's final hidden
state at i, runs one Llama decoder layer and outputs f_hat_{i+1}; the target's own LM head turns
f_hat_{i+1} into a distribution over token_{i+2}. Drafting continues in feature space: a tree node
with token x below a node whose predicted feature is f_hat reads fc([embed(x); f_hat]).
The target's embedding and LM head are reused, so a head checkpoint holds only fc and the layer.

Checkpoint layout: config.json (a Llama decoder config of the target's width) + model.safetensors
(or pytorch_model.bin, loaded with weights_only=True), keys "fc.*" and "layer.*".
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from engine.cache import CachedModel
from engine.sampling import SamplingParams, process_logits
from engine.tree import DraftModelTreeDrafter, DraftTree, TreeShape, ancestor_path, node_depths, tree_attention


class EagleHead(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
        config._attn_implementation = "sdpa"  # a standalone layer gets no dispatch from a model
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=True)
        self.layer = LlamaDecoderLayer(config, layer_idx=0)
        self.rotary = LlamaRotaryEmbedding(config)

    @classmethod
    def for_target(cls, target_config) -> EagleHead:
        text = target_config.get_text_config()
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "hidden_act", "vocab_size", "attention_bias", "mlp_bias")
        values = {k: getattr(text, k) for k in keys if getattr(text, k, None) is not None}
        return cls(LlamaConfig(**values))

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """embeds, features [T, H]; position_ids [T]; mask [T, T] bool (True = may attend) -> [T, H]."""
        x = self.fc(torch.cat([embeds, features], dim=-1))[None]  # [1, T, H]
        additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(
            ~mask.to(x.device), torch.finfo(x.dtype).min
        )
        positions = position_ids[None].to(x.device)
        out = self.layer(
            x, attention_mask=additive[None, None], position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        return out[0]

    @classmethod
    def load(cls, folder: str | Path) -> EagleHead:
        folder = Path(folder)
        head = cls(LlamaConfig(**json.loads((folder / "config.json").read_text())))
        if (folder / "model.safetensors").exists():
            from safetensors.torch import load_file

            state = load_file(folder / "model.safetensors")
        else:
            state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        head.load_state_dict(state)
        return head.eval()

    def save(self, folder: str | Path) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(self.config.to_json_string())
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, folder / "model.safetensors")


class EagleDrafter(DraftModelTreeDrafter):
    """A token tree from an EAGLE head (dynamic EAGLE-2-style tree, or a static shape).

    Keeps the target's features for the committed positions (the target CachedModel is switched to
    keep_hidden). Per proposal the head runs once per depth over the context plus the partial tree
    (tree attention; position = prefix length + depth), memoising each node's predicted feature.
    """

    def __init__(self, head: EagleHead, target: CachedModel, shape: TreeShape | None = None,
                 top_k: int = 4, budget: int = 16, window: int = 512, name: str = "eagle"):
        super().__init__(target, shape, top_k=top_k, budget=budget, name=name)
        self.head = head.to(target.device, next(target.model.parameters()).dtype).eval()
        self.target = target
        self.window = window  # the head attends to at most this many committed positions
        self.features: torch.Tensor | None = None  # [n, H] target features of positions 0..n-1
        self.feature_ids: list[int] = []
        self._features = self.features
        self._f_hat: dict[int, torch.Tensor] = {}  # per proposal: node -> its predicted feature [H]
        target.keep_hidden = True

    def prefill(self, ids: list[int]) -> None:
        self._sync(ids)

    def commit(self, ids: list[int]) -> None:
        pass  # features are synced from the target at the next proposal

    def _sync(self, ids: list[int]) -> torch.Tensor:
        """Target features [len(ids) - 1, H] of positions 0..len(ids)-2 (what the target caches)."""
        want = ids[:-1]
        have = next((i for i, (a, b) in enumerate(zip(self.feature_ids, want)) if a != b),
                    min(len(self.feature_ids), len(want)))
        fresh = self.target.hidden_at(have, len(want))
        if fresh is None or self.target.cached_ids[: len(want)] != want:
            # the target's latest forward did not cover the gap: re-feed it (the cache stays ids[:-1])
            self.target.truncate(min(have, self.target.common_prefix(want)))
            self.target.forward(want, [], 1)
            fresh = self.target.hidden_at(have, len(want))
        kept = self.features[:have] if self.features is not None else fresh[:0]
        self.features = torch.cat([kept, fresh])  # [len(want), H]
        self.feature_ids = list(want)
        return self.features

    def propose_tree(self, ids: list[int], depth: int, params: SamplingParams,
                     generator: torch.Generator | None) -> DraftTree:
        if len(ids) < 2:  # no target feature yet: propose the root alone (a plain step)
            return DraftTree(torch.tensor(ids[-1:], device=self.target.device), (-1,), None)
        self._features = self._sync(ids)
        self._f_hat = {}
        return super().propose_tree(ids, depth, params, generator)

    @torch.inference_mode()
    def _draft_scores(self, ids: list[int], tokens: list[int], parents: list[int], nodes: list[int],
                      params: SamplingParams) -> torch.Tensor:
        """Processed head logits [len(nodes), V] at the given tree nodes (root = the context's end)."""
        lm = self.target.model
        embed, lm_head = lm.get_input_embeddings(), lm.get_output_embeddings()
        start = max(0, len(ids) - 1 - self.window)
        context_f = self._features[start:]  # [C, H], positions start..L-2
        context_x = embed(torch.tensor(ids[start + 1 :], device=self.target.device))  # [C, H]: the next tokens
        n_ctx = context_f.shape[0]
        # non-root nodes read the predicted feature of their parent (memoised from earlier depths)
        tree_nodes = [n for n in range(1, len(tokens)) if n in self._f_hat or parents[n] in self._f_hat]
        tree_f = [self._f_hat[parents[n]] for n in tree_nodes]
        tree_x = embed(torch.tensor([tokens[n] for n in tree_nodes], dtype=torch.long, device=self.target.device))
        features = torch.cat([context_f, torch.stack(tree_f)]) if tree_nodes else context_f
        embeds = torch.cat([context_x, tree_x]) if tree_nodes else context_x
        n = n_ctx + len(tree_nodes)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:, :n_ctx] = True
        mask[:n_ctx, :n_ctx] = torch.ones(n_ctx, n_ctx, dtype=torch.bool).tril()
        ancestors = tree_attention(parents)  # [N, N]
        index = torch.tensor(tree_nodes, dtype=torch.long)
        if tree_nodes:
            mask[n_ctx:, n_ctx:] = ancestors[index][:, index]
        depths = node_depths(parents)
        positions = torch.cat([torch.arange(start, start + n_ctx),
                               torch.tensor([len(ids) - 2 + depths[m] for m in tree_nodes], dtype=torch.long)])
        out = self.head(embeds, features.to(embeds.dtype), positions, mask)  # [n, H]
        self._f_hat[0] = out[n_ctx - 1]
        for row, node in enumerate(tree_nodes):
            self._f_hat[node] = out[n_ctx + row]
        logits = lm_head(torch.stack([self._f_hat[m] for m in nodes]))[:, : self.target.n_vocab]  # [len(nodes), V]
        empty = torch.zeros(0, dtype=torch.long, device=logits.device)
        rows = []
        for i, node in enumerate(nodes):
            history = torch.tensor(ids + [tokens[m] for m in ancestor_path(parents, node)], device=logits.device)
            rows.append(process_logits(logits[i : i + 1].float(), params, history, empty)[0])
        return torch.stack(rows)  # [len(nodes), V]
