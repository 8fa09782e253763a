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

Where SpecLens's native kernels are built (engine/runtime/native_kernels.py), a float32 model on CPU runs every
attention call, plain and masked alike, on their batch-invariant attention instead
(`use_native_attention`): a query's result is then bit for bit the same whether it is decoded alone
or verified inside a draft block or tree, and with the native linears so is the whole forward.
"""

from __future__ import annotations

import torch
from torch import nn

ATTENTION_NAME = "speclens_sdpa"
NATIVE_ATTENTION_NAME = "speclens_native"


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


def _native_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF attention-interface function on the native kernel (one sequence, float32 on CPU, a mask that
    only allows or forbids); anything else, or a mask with other values, goes to `_attention`."""
    from speclens.engine.runtime.native_kernels import native_build

    native, mask = native_build().module, attention_mask
    if (native is not None and query.shape[0] == 1 and not dropout and query.dtype == torch.float32
            and query.device.type == "cpu" and (mask is None or (mask.dim() == 4 and mask.shape[:2] == (1, 1)))
            and all(kwargs.get(name) is None for name in ("position_bias", "softcap", "s_aux", "sinks"))):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        try:
            out = native.attention(query[0].transpose(0, 1), key[0], value[0], None if mask is None else mask[0, 0],
                                   scale, getattr(module, "is_causal", True))  # [T, H, D]
            return out[None], None
        except RuntimeError:  # a shape or a mask the kernel does not take
            pass
    return _attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def use_native_attention(model: nn.Module) -> bool:
    """Switch a loaded HF model (on "sdpa" or grouped attention) to the native attention kernel; True
    if switched. Models whose head size is not a multiple of 16 floats (the kernel's vector width)
    stay where they are."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 16:
        return False
    return _switch(model, NATIVE_ATTENTION_NAME, _native_attention, (ATTENTION_NAME, "sdpa"))


def is_native_attention(model: nn.Module) -> bool:
    return getattr(model.config, "_attn_implementation", None) == NATIVE_ATTENTION_NAME


def use_grouped_attention(model: nn.Module) -> bool:
    """Switch a loaded HF model from "sdpa" to grouped_query_attention for masked query blocks; True if
    switched (models on another attention implementation, or that cannot switch, are left alone)."""
    return _switch(model, ATTENTION_NAME, _attention, ("sdpa",))


def _switch(model: nn.Module, name: str, function, switch_from: tuple[str, ...]) -> bool:
    """Register `function` as HF attention implementation `name` (masks built as for SDPA) and move the
    model to it if it is on one of `switch_from`; True if it is on `name` now."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) not in switch_from:
        return False
    # HF's registries are keyed by name; registering the same functions again is harmless
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
    except (ValueError, AttributeError, NotImplementedError):
        return False
    return model.config._attn_implementation == name
