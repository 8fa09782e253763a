"""A causal LM together with its KV cache and the exact token ids the cache holds.

Rollback is a crop of the cache to a prefix. `forward` feeds whatever part of the requested context
the cache does not hold yet, so prefill, decode, verify and "catch up after a fully accepted block"
are one code path. Invariant: `cached_ids` always equals the tokens whose keys and values the cache
holds, position for position.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class CachedModel:
    def __init__(self, model: PreTrainedModel, n_vocab: int | None = None):
        self.model = model
        self.device = next(model.parameters()).device
        # Logits are cut to the tokenizer's vocabulary so that padding ids are never sampled.
        self.n_vocab = n_vocab or model.config.get_text_config().vocab_size
        self.cached_ids: list[int] = []
        self._cache = DynamicCache(config=model.config)

    def reset(self) -> None:
        self.cached_ids = []
        self._cache = DynamicCache(config=self.model.config)

    def common_prefix(self, ids: list[int]) -> int:
        n = min(len(ids), len(self.cached_ids))
        if self.cached_ids[:n] == ids[:n]:
            return n
        return next(i for i in range(n) if self.cached_ids[i] != ids[i])

    def truncate(self, n: int) -> None:
        """Roll the cache back so that it holds exactly the first n cached tokens."""
        drop = len(self.cached_ids) - n
        if drop < 0:
            raise ValueError(f"cannot truncate {len(self.cached_ids)} cached tokens to {n}")
        if drop:
            self._cache.crop(-drop)
            del self.cached_ids[n:]

    def prefill(self, ids: list[int]) -> None:
        """Make the cache hold exactly ids[:-1] (the newest token is fed by the next step)."""
        if len(ids) > 1:
            self.forward(ids[:-1], [], 1)
        else:
            self.truncate(0)

    @torch.inference_mode()
    def forward(self, context: list[int], block: list[int], n_logits: int) -> torch.Tensor:
        """Logits [n_logits, V] of the last n_logits positions of context + block.

        The cache is first rolled back to its longest prefix shared with context + block; the rest
        is fed in one forward; positions whose logits are asked for are always fed.
        """
        ids = context + block
        if not 1 <= n_logits <= len(ids):
            raise ValueError(f"n_logits={n_logits} out of range for {len(ids)} tokens")
        keep = min(self.common_prefix(ids), len(ids) - n_logits)
        self.truncate(keep)
        new = ids[keep:]
        input_ids = torch.tensor([new], dtype=torch.long, device=self.device)
        out = self.model(
            input_ids=input_ids,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=n_logits,
        )
        self.cached_ids.extend(new)
        return out.logits[0, -n_logits:, : self.n_vocab]
