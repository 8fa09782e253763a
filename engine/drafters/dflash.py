"""DFlash parallel drafters (Chen, Liang, Liu 2026): a whole block of draft tokens in one forward.

A few decoder layers read a block of B queries, the last committed token followed by B - 1 mask
tokens (embedded by the target's own embedding), at positions s .. s + B - 1, and attend without a
mask to keys and values of the committed context and of the block itself. The context's keys and
values come from the target's features: the hidden states of a few target layers, side by side,
fused once as C = hidden_norm(fc([h_a; h_b; ...])) and projected by each draft layer's k/v (with its
k norm and RoPE at the position). Row i of the block (after the final norm, through the target's LM
head) scores the token at position s + i; row 0, the known token, is dropped. One forward proposes
B - 1 tokens, where an EAGLE head runs one step per drafted depth.

Per draft layer the context's keys and values are cached (AppendLayer) for the committed positions
0 .. s - 1, extended as tokens are committed and cropped back where the text changes; the block's own
keys and values are never kept. The draft context trails by one token: the newest token has no
target feature yet and appears only as the block's first query.

Checkpoint layout (z-lab's `*-DFlash-b16` folders, read without their remote code): config.json, a
Qwen3 decoder config of the draft with `block_size` (top level or in `dflash_config`), `dflash_config`
{`target_layer_ids`, `mask_token_id`} and `num_target_layers`; weights `fc.weight` [H, n H],
`hidden_norm.weight`, `norm.weight`, `layers.{l}.{input_layernorm, post_attention_layernorm}.weight`,
`layers.{l}.self_attn.{q,k,v,o}_proj.weight`, `layers.{l}.self_attn.{q,k}_norm.weight` [head_dim],
`layers.{l}.mlp.{gate,up,down}_proj.weight`; no embedding and no LM head (the target's are used).
`target_layer_ids` name decoder layers whose *output* is read: HF's hidden_states index id + 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RMSNorm, Qwen3RotaryEmbedding

from speclens.engine.decoding.drafter import Draft
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.drafters.eagle import _rotate_half
from speclens.engine.runtime.cache import AppendLayer, CachedModel, common_prefix
from speclens.engine.runtime.cpu_kernels import drafter_module, drafting_dtype

WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def is_dflash(config: dict) -> bool:
    """Whether a head folder's config.json describes a DFlash drafter."""
    return "dflash_config" in config or any("DFlash" in a for a in config.get("architectures") or ())


def default_target_layers(target_layers: int, draft_layers: int) -> tuple[int, ...]:
    """z-lab's default when a config names no target layers: draft_layers ids spread evenly over
    1 .. target_layers - 3 (36 and 5 give 1, 9, 17, 25, 33)."""
    top = max(target_layers - 3, 1)
    if draft_layers == 1:
        return ((1 + top) // 2,)
    return tuple(round(1 + i * (top - 1) / (draft_layers - 1)) for i in range(draft_layers))


class DFlashHead(nn.Module):
    draft_vocab = None  # proposals go through the target's whole LM head

    def __init__(self, config: Qwen3Config, block_size: int, mask_token_id: int,
                 target_layer_ids: tuple[int, ...] | None, target_hidden_size: int | None = None):
        super().__init__()
        self.config = config
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.target_layer_ids = tuple(target_layer_ids) if target_layer_ids else None
        n = len(self.target_layer_ids) if self.target_layer_ids else config.num_hidden_layers
        hidden = config.hidden_size
        self.target_hidden_size = target_hidden_size or hidden
        self.fc = nn.Linear(n * self.target_hidden_size, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(hidden, config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)

    def layer_ids_for(self, target_layers: int) -> tuple[int, ...]:
        return self.target_layer_ids or default_target_layers(target_layers, self.config.num_hidden_layers)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [T, n H_target] -> the fused context C [T, H] every layer reads."""
        return self.hidden_norm(self.fc(features))

    def _qkv(self, attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [heads, T, D] (None for context rows), k, v [kv heads, T, D] of rows x [T, H] at cos/sin [T, D]."""
        n, d = x.shape[0], attention.head_dim
        k = attention.k_norm(attention.k_proj(x).view(n, -1, d)).transpose(0, 1)
        v = attention.v_proj(x).view(n, -1, d).transpose(0, 1)
        return k * cos + _rotate_half(k) * sin, v

    def extend(self, caches: list[AppendLayer], context: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the keys and values of context rows C [T, H] at positions [T] to each layer's cache."""
        cos, sin = self.rotary(context, positions.to(context.device)[None])  # [1, T, D]
        for layer, cache in zip(self.layers, caches):
            k, v = self._qkv(layer.self_attn, context, cos[0], sin[0])
            cache.update(k[None], v[None])

    def block(self, caches: list[AppendLayer], embeds: torch.Tensor, start: int) -> torch.Tensor:
        """The block's rows [B, H] (embeddings of the known token and the masks, at positions start ..
        start + B - 1) through every layer, attending to the layer's cached context and the whole block
        (no mask); returns the final-normed rows [B, H]. The caches are left as they were."""
        b = embeds.shape[0]
        cos, sin = self.rotary(embeds, torch.arange(start, start + b, device=embeds.device)[None])
        h = embeds
        for layer, cache in zip(self.layers, caches):
            held = (cache.keys[0], cache.values[0]) if cache.get_seq_length() else None
            h = self._layer(layer, h, cos[0], sin[0], held, None)
        return self.norm(h)

    def train_forward(self, embeds: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                      context_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Training: blocks' rows embeds [Q, H] at positions [Q] against context rows C [P, H] at
        context_positions [P], under mask [Q, P + Q] (True = may attend) -> final-normed rows [Q, H]."""
        cos, sin = self.rotary(embeds, positions[None])
        ccos, csin = self.rotary(context, context_positions[None])
        h = embeds
        for layer in self.layers:
            h = self._layer(layer, h, cos[0], sin[0], self._qkv(layer.self_attn, context, ccos[0], csin[0]), mask)
        return self.norm(h)

    def _layer(self, layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               context_kv: tuple[torch.Tensor, torch.Tensor] | None, mask: torch.Tensor | None) -> torch.Tensor:
        """One draft layer on rows h [Q, H] at cos/sin [Q, D]: queries attend to the context's keys and
        values [kv heads, P, D] (if any) and to the rows' own, under mask [Q, P + Q] or none."""
        attention, q_rows = layer.self_attn, h.shape[0]
        x = layer.input_layernorm(h)
        q = attention.q_norm(attention.q_proj(x).view(q_rows, -1, attention.head_dim)).transpose(0, 1)
        q = q * cos + _rotate_half(q) * sin  # [heads, Q, D]
        k, v = self._qkv(attention, x, cos, sin)  # [kv heads, Q, D]
        if context_kv is not None:
            k, v = torch.cat([context_kv[0], k], dim=1), torch.cat([context_kv[1], v], dim=1)
        groups = q.shape[0] // k.shape[0]
        stacked = q.reshape(k.shape[0], groups * q_rows, -1)  # query heads of a group stacked: no key copies
        bias = None if mask is None else mask.repeat(groups, 1)[None]  # [1, groups Q, P + Q]
        out = nn.functional.scaled_dot_product_attention(stacked, k, v, attn_mask=bias, scale=attention.scaling)
        out = out.reshape(q.shape[0], q_rows, -1).transpose(0, 1).reshape(q_rows, -1)  # [Q, heads D]
        h = h + attention.o_proj(out)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def save(self, folder: str | Path) -> None:
        """In z-lab's layout (config.json with dflash_config, model.safetensors), which `load` reads."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {**self.config.to_dict(), "architectures": ["DFlashDraftModel"], "block_size": self.block_size,
                  "target_hidden_size": self.target_hidden_size, **getattr(self, "extra_config", {}),
                  "dflash_config": {"mask_token_id": self.mask_token_id,
                                    **({"target_layer_ids": list(self.target_layer_ids)}
                                       if self.target_layer_ids else {})}}
        if getattr(self, "num_target_layers", None):
            config["num_target_layers"] = self.num_target_layers
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items() if "rotary" not in k}
        save_file(state, folder / WEIGHTS[0])

    @classmethod
    def load(cls, folder: str | Path) -> DFlashHead:
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        extra = raw.get("dflash_config") or {}
        block = int(extra.get("block_size") or raw.get("block_size") or 16)
        if "mask_token_id" not in extra and "mask_token_id" not in raw:
            raise ValueError("the DFlash config names no mask_token_id")
        mask = int(extra.get("mask_token_id", raw.get("mask_token_id")))
        ids = extra.get("target_layer_ids") or raw.get("target_layer_ids")
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "dflash_config")}
        config = Qwen3Config(**fields)
        head = cls(config, block, mask, tuple(ids) if ids else None, raw.get("target_hidden_size"))
        head.num_target_layers = raw.get("num_target_layers")
        if (folder / WEIGHTS[0]).exists():
            from safetensors.torch import load_file

            state = load_file(folder / WEIGHTS[0])
        else:
            state = torch.load(folder / WEIGHTS[1], map_location="cpu", weights_only=True)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        for unused in ("embed_tokens.weight", "lm_head.weight"):  # the target's are used
            state.pop(unused, None)
        head.load_state_dict(state, strict=False)
        missing = set(head.state_dict()) - set(state) - {k for k in head.state_dict() if "rotary" in k}
        if missing:
            raise ValueError(f"the DFlash weights lack {', '.join(sorted(missing)[:3])}")
        return head.eval()


class DFlashDrafter:
    """Proposes up to block_size - 1 tokens per step from one forward of a DFlash head."""

    def __init__(self, head: DFlashHead, target: CachedModel, name: str = "dflash"):
        self.name = name
        layers = target.model.config.get_text_config().num_hidden_layers
        self.layer_ids = head.layer_ids_for(layers)
        self.feature_layers = tuple(i + 1 for i in self.layer_ids)  # output of layer i: HF's index i + 1
        target.request_features(self.feature_layers)
        self.head = drafter_module(head, target.model)
        self.dtype = drafting_dtype(target.model)
        self.target = target
        self.block_size, self.mask_token_id = head.block_size, head.mask_token_id
        self.caches = [AppendLayer() for _ in self.head.layers]  # context keys/values of positions 0..n-1
        self.cache_ids: list[int] = []  # the committed tokens whose positions the caches hold

    def prefill(self, ids: list[int]) -> None:
        pass  # the context is fed at the first proposal, from the features the target's prefill kept

    def commit(self, ids: list[int]) -> None:
        if len(ids) >= 2:  # the verifying forward still holds the accepted tokens' features: feed them now
            self._sync(ids)

    @torch.inference_mode()
    def _sync(self, ids: list[int]) -> bool:
        """Make the caches hold positions 0 .. len(ids) - 2 (all committed but the newest token). False when
        the target no longer holds the features that needs (the next proposal re-feeds the target)."""
        want = ids[:-1]
        have = min(common_prefix(self.cache_ids, want), self.caches[0].get_seq_length())
        for cache in self.caches:
            drop = cache.get_seq_length() - have
            if drop > 0:
                cache.crop(-drop)
        self.cache_ids = self.cache_ids[:have]
        if have == len(want):
            return True
        features = self.target.features_at(have, len(want), self.feature_layers)
        if features is None or self.target.cached_ids[: len(want)] != want:
            return False
        context = self.head.context(features.to(self.dtype))  # [new, H]
        self.head.extend(self.caches, context, torch.arange(have, len(want)))
        self.cache_ids = list(want)
        return True

    @torch.inference_mode()
    def propose(self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        k = min(k, self.block_size - 1)  # the block is always whole: its rows attend to each other
        device = self.target.device
        if len(ids) < 2 or k < 1:
            return Draft(tokens=torch.zeros(0, dtype=torch.long, device=device), probs=None)
        if not self._sync(ids):  # the target's features of the gap are gone: re-feed the target, keeping them
            want = ids[:-1]
            self.target.truncate(min(self.target.common_prefix(want), len(self.cache_ids)))
            self.target.prefill(ids)
            self._sync(ids)
        block = torch.tensor([ids[-1]] + [self.mask_token_id] * (self.block_size - 1), device=device)
        embeds = self.target.model.get_input_embeddings()(block).to(self.dtype)  # [B, H]
        rows = self.head.block(self.caches, embeds, len(ids) - 1)[1 : k + 1]  # [k, H]: row i scores position s + i
        logits = self.target.model.get_output_embeddings()(rows.to(self.target.model.dtype))[:, : self.target.n_vocab]
        empty = torch.zeros(0, dtype=torch.long, device=device)
        history = torch.tensor(ids, device=device) if params.repetition_penalty != 1.0 else empty
        scores = process_logits(logits.float(), params, history, empty)  # [k, V]
        if params.greedy:
            return Draft(tokens=scores.argmax(-1), probs=None)
        probs = scores.softmax(-1)
        return Draft(tokens=torch.multinomial(probs, 1, generator=generator)[:, 0], probs=probs)
