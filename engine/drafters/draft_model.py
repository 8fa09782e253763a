"""A smaller causal LM of the same vocabulary drafts k tokens autoregressively."""

from __future__ import annotations

import torch

from speclens.engine.decoding.drafter import Draft
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.runtime.cache import CachedModel


class DraftModelDrafter:
    name = "draft"

    def __init__(self, model: CachedModel):
        self.lm = model

    def prefill(self, ids: list[int]) -> None:
        self.lm.prefill(ids)

    def commit(self, ids: list[int]) -> None:
        self.lm.truncate(self.lm.common_prefix(ids))

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for _ in range(k):
            logits = self.lm.forward(ids, tokens, 1)  # [1, V]
            history = torch.tensor(ids + tokens, device=logits.device)
            scores = process_logits(logits, params, history, history[:0])  # [1, V]
            probs = scores.softmax(-1)
            if params.greedy:
                token = int(scores.argmax(-1))
            else:
                token = int(torch.multinomial(probs[0], 1, generator=generator))
            tokens.append(token)
            rows.append(probs[0])
        device = self.lm.device
        if not tokens:
            return Draft(torch.empty(0, dtype=torch.long, device=device), None)
        return Draft(torch.tensor(tokens, device=device), torch.stack(rows))
