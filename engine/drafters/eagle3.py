"""EAGLE-3 heads (Li et al. 2025): a draft layer over a fusion of low, middle and high target layers.

At committed position i the head reads g_i = fc([h_a(i); h_b(i); h_c(i)]), three of the target's
hidden states (HF's `hidden_states` indices a, b, c: the output of layer j - 1 is index j; by default
2, L/2 and L - 3 of an L-layer target, as SafeAILab and vLLM choose), and the target's embedding e of
token_{i+1}. Its one decoder layer attends over [norm(e); norm(g)] (so q/k/v read 2H), adds the
attention and the MLP to g, and outputs the next feature g'; its own norm and LM head score a draft
vocabulary, and `d2t` maps a draft id d to the target's id d + d2t[d]. Deeper in the draft the head
reads its own g' in place of the fused target features (no fc), as training-time test trained it to.

The drafting machinery (the head's KV cache over committed positions, EAGLE-2 dynamic trees, chains)
is EagleDrafter's; only where the features come from and how tokens are scored differ.

Checkpoint layout (SafeAILab EAGLE-3 and SpecForge): `config.json`, a Llama decoder config of the
draft with `draft_vocab_size`, optionally `target_hidden_size`, the layer ids as
`eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`) and `norm_before_residual`;
`model.safetensors` (or `pytorch_model.bin`, read with weights_only=True) with `fc.weight`
[H, 3 H_target], `midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight`,
`midlayer.self_attn.{q,k,v,o}_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` [N, H], `d2t` [N] and `t2d` [V] (and perhaps an `embed_tokens.weight`, unused: the
target's embedding is read, as in EAGLE-1).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.tree import TreeShape
from speclens.engine.drafters.eagle import EagleDrafter, head_attention
from speclens.engine.runtime.cache import AppendLayer, CachedModel
from speclens.engine.runtime.cpu_kernels import drafter_linear, drafting_dtype

WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def default_feature_layers(layers: int) -> tuple[int, int, int]:
    """The target hidden states an EAGLE-3 head reads when its config does not say: 2, L/2, L - 3."""
    return (min(2, layers), layers // 2, max(layers - 3, 0))


def is_eagle3(config: dict) -> bool:
    """Whether a head folder's config.json describes an EAGLE-3 head."""
    return "draft_vocab_size" in config or any("Eagle3" in a for a in config.get("architectures") or ())


class Eagle3Attention(nn.Module):
    """The layer's attention: q/k/v over [norm(e); norm(g)] (2H wide), o back to H."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        self.heads, self.kv_heads = heads, kv_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(2 * hidden, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=bias)


class Eagle3Layer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps)  # over the token embedding
        self.hidden_norm = LlamaRMSNorm(config.hidden_size, eps)  # over the feature
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps)
        self.mlp = LlamaMLP(config)


class Eagle3Head(nn.Module):
    def __init__(self, config: LlamaConfig, draft_vocab_size: int, target_hidden_size: int | None = None,
                 feature_layers: tuple[int, ...] | None = None, norm_before_residual: bool = False):
        super().__init__()
        config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
        self.config = config
        hidden = config.hidden_size
        self.target_hidden_size = target_hidden_size or hidden
        self.feature_layers = tuple(feature_layers) if feature_layers else None  # None: the target's default
        self.norm_before_residual = norm_before_residual
        self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(config)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # draft id -> offset

    @property
    def draft_vocab(self) -> torch.Tensor:
        """[N] the target token id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @draft_vocab.setter
    def draft_vocab(self, vocab: torch.Tensor) -> None:  # [N] target ids, one per draft id
        self.d2t = vocab.long() - torch.arange(len(vocab), device=vocab.device)

    def layers_for(self, target_layers: int) -> tuple[int, ...]:
        return self.feature_layers or default_feature_layers(target_layers)

    def forward(self, embeds: torch.Tensor, features: torch.Tensor, position_ids: torch.Tensor,
                mask: torch.Tensor, cache: AppendLayer | None = None) -> torch.Tensor:
        """embeds [T, H]; features [T, 3 H_target] (fused target states: through fc) or [T, H] (the head's
        own outputs, deeper in a draft); position_ids [T]; mask [T, P + T] bool over the P entries in
        `cache` and the new ones -> the next features [T, H] (before the final norm)."""
        layer, attention = self.midlayer, self.midlayer.self_attn
        g = self.fc(features) if features.shape[-1] != self.config.hidden_size else features  # [T, H]
        normed = layer.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        x = torch.cat([layer.input_layernorm(embeds.to(g.dtype)), normed], dim=-1)  # [T, 2H]
        h = residual + head_attention(attention, x, self.rotary, g, position_ids, mask, cache, attention.heads,
                                      attention.kv_heads)  # [T, H]
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @classmethod
    def load(cls, folder: str | Path) -> Eagle3Head:
        """A SafeAILab / SpecForge EAGLE-3 checkpoint (see the module docstring), or one `save` wrote."""
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        layers = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        fields = {k: v for k, v in raw.items() if k not in ("architectures", "eagle_config")}
        head = cls(LlamaConfig(**fields), int(raw["draft_vocab_size"]), raw.get("target_hidden_size"),
                   tuple(layers) if layers else None, bool(raw.get("norm_before_residual", False)))
        if (folder / WEIGHTS[0]).exists():
            from safetensors.torch import load_file

            state = load_file(folder / WEIGHTS[0])
        else:
            state = torch.load(folder / WEIGHTS[1], map_location="cpu", weights_only=True)
        state = {k.removeprefix("model."): v for k, v in state.items()}
        state.pop("embed_tokens.weight", None)
        state.pop("t2d", None)  # the inverse map (target id -> in the draft vocabulary): d2t says it all
        if "d2t" not in state:  # a head over the whole vocabulary
            state["d2t"] = torch.zeros(head.lm_head.out_features, dtype=torch.long)
        head.load_state_dict({**state, "d2t": state["d2t"].long()})
        draft_vocab = head.draft_vocab
        distinct = len(set(draft_vocab.tolist())) == len(draft_vocab)
        if draft_vocab.min() < 0 or draft_vocab.max() >= head.config.vocab_size or not distinct:
            raise ValueError(f"d2t must map the {len(draft_vocab)} draft ids to distinct target ids below "
                             f"{head.config.vocab_size}")
        return head.eval()

    def save(self, folder: str | Path) -> None:
        """In the SpecForge layout (config.json + model.safetensors, with t2d), which `load` reads."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = {**self.config.to_dict(), "architectures": ["LlamaForCausalLMEagle3"],
                  "draft_vocab_size": self.lm_head.out_features, "target_hidden_size": self.target_hidden_size,
                  "norm_before_residual": self.norm_before_residual}
        if self.feature_layers:
            config["eagle_aux_hidden_state_layer_ids"] = list(self.feature_layers)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items() if not k.startswith("rotary")}
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[self.draft_vocab.cpu()] = True
        save_file({**state, "t2d": t2d}, folder / WEIGHTS[0])


class Eagle3Drafter(EagleDrafter):
    """EagleDrafter over an EAGLE-3 head: features are the target's fused hidden states, and draft tokens
    come from the head's own LM head over its draft vocabulary, mapped to target ids."""

    def __init__(self, head: Eagle3Head, target: CachedModel, shape: TreeShape | None = None, top_k: int = 4,
                 budget: int = 16, name: str = "eagle3", step_cost: StepCost | None = None):
        layers = target.model.config.get_text_config().num_hidden_layers
        self.feature_layers = head.layers_for(layers)
        target.request_features(self.feature_layers)
        super().__init__(head, target, shape, top_k=top_k, budget=budget, name=name, step_cost=step_cost)

    def _scoring(self, head: nn.Module, target: CachedModel) -> tuple[torch.Tensor | None, nn.Module]:
        """(target ids [N] of the draft ids kept, norm + the head's LM head rows for them): draft ids whose
        target id is padding (past the tokenizer) are never proposed."""
        vocab = head.draft_vocab
        keep = vocab < target.n_vocab
        weight = head.lm_head.weight.detach()[keep].to(target.device, drafting_dtype(target.model))
        return vocab[keep].to(target.device), nn.Sequential(self.head.norm, drafter_linear(target.model, weight, None))

    def _target_features(self, start: int, end: int) -> torch.Tensor | None:
        return self.target.features_at(start, end, self.feature_layers)
