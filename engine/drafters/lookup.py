"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's tail."""

from __future__ import annotations

import torch

from engine.drafters import Draft, StatelessDrafter
from engine.sampling import SamplingParams


class PromptLookupDrafter(StatelessDrafter):
    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        tokens = lookup(ids, k, self.max_ngram, self.min_ngram)
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=None)


def lookup(ids: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest matching tail n-gram."""
    if k <= 0 or len(ids) < 2:
        return []
    context = torch.tensor(ids)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        windows = context[:-1].unfold(0, n, 1)  # [L-n, n]: every n-gram that has a successor
        starts = (windows == tail).all(dim=1).nonzero().flatten()
        if starts.numel():
            follow = int(starts[-1]) + n
            return ids[follow : follow + k]
    return []
