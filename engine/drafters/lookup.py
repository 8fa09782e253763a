"""Prompt lookup decoding: copy what followed the latest earlier occurrence of the context's tail."""

from __future__ import annotations

import torch

from speclens.engine.decoding.drafter import Draft, StatelessDrafter, StepCost, worthwhile_count
from speclens.engine.decoding.sampling import SamplingParams


class PromptLookupDrafter(StatelessDrafter):
    """With `step_cost`, the chain is cut to the tokens worth verifying (worthwhile_count), each valued at
    LOOKUP_ACCEPTANCE for the length of the tail it matched: K becomes a maximum, a strong match drafts
    deep and a weak one little or nothing."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, step_cost: StepCost | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.step_cost = step_cost

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        tokens, values = valued_lookup(ids, k, self.max_ngram, self.min_ngram)
        if self.step_cost is not None:
            tokens = tokens[: worthwhile_count(values, self.step_cost)]
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=None)


# How often a lookup chain was right through each depth, by the length of the tail n-gram it matched:
# P(its first d tokens are the target's next d), d = 1, 2, ... (the last value holds beyond). Measured
# teacher-forced at every position of the greedy answers (128 tokens) of SmolLM2-135M-Instruct to the 20
# Self-Instruct prompts train-drafter holds out (none is a Spec-Bench prompt): 170-1012 chains per n.
# A tree that mixes drafters ranks its nodes by these (engine.tree.LookupGraftedDrafter).
LOOKUP_ACCEPTANCE: dict[int, tuple[float, ...]] = {
    1: (0.25, 0.15, 0.12, 0.10, 0.09, 0.05, 0.01),
    2: (0.53, 0.40, 0.30, 0.27, 0.17, 0.10, 0.09),
    3: (0.86, 0.75, 0.68, 0.55, 0.50, 0.48, 0.45),
}


def lookup(ids: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest matching tail n-gram."""
    return lookup_match(ids, k, max_ngram, min_ngram)[0]


def lookup_match(ids: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], int]:
    """lookup's chain and the length n of the tail n-gram it matched (0: no match)."""
    if k <= 0 or len(ids) < 2:
        return [], 0
    context = torch.tensor(ids)
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        tail = context[-n:]
        windows = context[:-1].unfold(0, n, 1)  # [L-n, n]: every n-gram that has a successor
        starts = (windows == tail).all(dim=1).nonzero().flatten()
        if starts.numel():
            follow = int(starts[-1]) + n
            return ids[follow : follow + k], n
    return [], 0


def valued_lookup(ids: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[list[int], list[float]]:
    """lookup's chain and each token's value: how likely the chain is right through it (LOOKUP_ACCEPTANCE
    for the length of the tail it matched)."""
    tokens, matched = lookup_match(ids, k, max_ngram, min_ngram)
    return tokens, chain_acceptance(LOOKUP_ACCEPTANCE, matched, len(tokens))


def chain_acceptance(table: dict[int, tuple[float, ...]], n: int, length: int) -> list[float]:
    """Prior acceptance of a chain's first `length` prefixes from a table such as LOOKUP_ACCEPTANCE,
    for a match of n tokens (beyond the table: its longest row, and its last value)."""
    row = table[min(n, max(table))] if n > 0 else (0.0,)
    return [row[min(d, len(row) - 1)] for d in range(length)]
