"""A drafter with a known acceptance rate, for measuring speed on models nobody can draft for.

It replays the target's own greedy continuation (the reference) and replaces each token, with
probability 1 - acceptance, by a different random token. At temperature 0 a draft token is accepted
exactly when it was not replaced, so the chance that a drafted position is accepted, given the ones
before it were, is `acceptance`, by construction. Random-weight models (benchmarks of big shapes
without their weights) thus get a realistic speculative workload with the acceptance as a knob.
Off the reference (sampling, or past its end) it proposes nothing, which is a plain decoding step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from speclens.engine.decoding.drafter import Draft, StatelessDrafter
from speclens.engine.decoding.sampling import SamplingParams

if TYPE_CHECKING:  # the decoding loop needs transformers; packaging/gpu_bench.py needs only torch
    from speclens.engine.runtime.cache import CachedModel


class SyntheticDrafter(StatelessDrafter):
    name = "synthetic"

    def __init__(self, reference: Sequence[int], acceptance: float, vocab: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if vocab < 2:
            raise ValueError("need a vocabulary of at least 2 tokens to corrupt a token")
        self.reference = list(reference)
        self.acceptance = acceptance
        self.vocab = vocab
        self.rng = random.Random(seed)

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        n = len(ids)
        truth = self.reference[n : n + k] if self.reference[:n] == ids else []
        tokens = [t if self.rng.random() < self.acceptance else self._other(t) for t in truth]
        return Draft(tokens=torch.tensor(tokens, dtype=torch.long), probs=None)

    def _other(self, token: int) -> int:
        """A uniformly random token that is not `token` (so the corruption is always rejected)."""
        return (token + self.rng.randrange(1, self.vocab)) % self.vocab


def greedy_reference(target: CachedModel, prompt_ids: Sequence[int], n: int) -> list[int]:
    """prompt_ids followed by the target's first n greedy tokens (through the engine's own step)."""
    from speclens.engine.decoding.step import speculative_step

    ids = list(prompt_ids)
    target.prefill(ids)
    params = SamplingParams()
    for _ in range(n):
        ids += speculative_step(target, None, ids, 0, params, None).tokens
    return ids
