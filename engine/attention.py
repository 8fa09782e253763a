"""Grouped-query attention for blocks of queries without copying the KV cache.

A model with grouped-query attention (the default SmolLM2: 9 query heads over 3 key/value heads)
shares each key/value head among several query heads. For one query token HF folds those query
heads together, but for a block of queries under a mask (a draft being verified, a token tree) it
repeats every cached key and value once per query head before calling SDPA: a copy of the whole
cache in every layer on every verification, which plain decoding never pays. The cost grows with the
context: about 4 ms per verification at 700 tokens on the default model on 2 CPU cores.

Here the query heads that share a key/value head are stacked along the query axis instead, so SDPA
reads the cache as it is. The numbers are the same: each query row still meets the same keys, values
and mask row. `use_grouped_attention` switches a loaded model over; the plain path (one query) and
prefill (no mask, causal) go through HF's own SDPA function unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION_NAME = "speclens_sdpa"


def grouped_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """query [B, H, T, D]; key, value [B, G, S, D] with H a multiple of G; mask [B or 1, 1, T, S] (bool,
    True = may attend, or additive) -> [B, H, T, D]. Query head h uses key/value head h // (H / G)."""
    batch, heads, length, dim = query.shape
    groups = heads // key.shape[1]
    stacked = query.reshape(batch, key.shape[1], groups * length, dim)  # rows: (head in group, query)
    if mask is not None:
        mask = mask.repeat(1, 1, groups, 1)  # [B or 1, 1, groups * T, S], the same rows' order
    out = nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=mask, scale=scale)
    return out.reshape(batch, heads, length, dim)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function: grouped_query_attention for masked blocks of queries, HF's
    SDPA otherwise. Returns [B, T, H, D] as HF's functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or attention_mask.dim() != 4 or attention_mask.shape[1] != 1
            or query.shape[2] == 1 or dropout or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    mask = attention_mask[:, :, :, : key.shape[-2]]
    out = grouped_query_attention(query, key, value, mask, scaling)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: nn.Module) -> bool:
    """Switch a loaded HF model from "sdpa" to grouped_query_attention for masked query blocks; True if
    switched (models on another attention implementation, or that cannot switch, are left alone)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    # HF's registries are keyed by name; registering the same functions again is harmless
    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    try:
        model.set_attn_implementation(ATTENTION_NAME)
    except (ValueError, AttributeError, NotImplementedError):
        return False
    return model.config._attn_implementation == ATTENTION_NAME
