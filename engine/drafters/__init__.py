"""Drafters: one small interface, several implementations.

A drafter proposes up to k tokens that continue the committed ids, together with the distributions
it sampled them from (None for deterministic drafts, which verification treats as one-hot rows).
The decoding loop never special-cases a drafter kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.sampling import SamplingParams


@dataclass(frozen=True)
class Draft:
    tokens: torch.Tensor  # [k] long; k may be less than asked (even 0)
    probs: torch.Tensor | None  # [k, V] distributions the tokens were sampled from; None: deterministic

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter(Protocol):
    name: str

    def prefill(self, ids: list[int]) -> None:
        """A new generation starts from ids (lets a drafter warm its cache before timing starts)."""

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        """Up to k tokens continuing ids."""

    def commit(self, ids: list[int]) -> None:
        """ids are the committed tokens after a step: drop any state past them."""


def empty_draft(device: torch.device | str = "cpu") -> Draft:
    return Draft(tokens=torch.empty(0, dtype=torch.long, device=device), probs=None)


class StatelessDrafter:
    """Base for drafters that keep nothing between steps: prefill and commit have nothing to do."""

    def prefill(self, ids: list[int]) -> None:
        pass

    def commit(self, ids: list[int]) -> None:
        pass


def worthwhile_count(values: Sequence[float], step_rows: float) -> int:
    """How many of the drafted tokens, valued in descending order (how likely each is to be accepted),
    are worth verifying when a step costs `step_rows` rows besides them: a step emits E = 1 + (the sum of
    the kept values) tokens at a cost of step_rows + (kept) rows, and the next token is kept while it
    raises E / cost, that is while its value exceeds the current E / cost. For a given count the most
    valuable tokens are best and E / cost rises and then falls with the count, so the count is the best."""
    expected, kept = 1.0, 0
    for value in values:
        if value <= expected / (step_rows + kept):
            break
        expected, kept = expected + value, kept + 1
    return kept


def worth_floor(step_rows: float | None) -> float:
    """The value at or below which worthwhile_count keeps nothing (its E / cost starts at 1 / step_rows and
    only rises): a dynamic tree need not draft below such nodes. 0 without a cut."""
    return 0.0 if step_rows is None else 1.0 / step_rows


def draft_vocab_rows(target, vocab: torch.Tensor | None) -> tuple[torch.Tensor | None, nn.Module]:
    """The target's LM head in drafting precision, cut to a head's draft vocabulary: (the token ids [N]
    its outputs score, None when it scores the whole vocabulary; the linear H -> N). target: CachedModel.
    Scoring only those rows is what a draft vocabulary saves; exactness never depends on it."""
    from engine.cpu_kernels import drafter_linear

    lm_head = target.model.get_output_embeddings()
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if vocab is None or vocab.numel() >= target.n_vocab:
        return None, drafter_linear(target.model, weight, bias)
    vocab = vocab[vocab < target.n_vocab].to(target.device)  # [N]
    return vocab, drafter_linear(target.model, weight[vocab], None if bias is None else bias[vocab])


def full_vocab_logits(logits: torch.Tensor, vocab: torch.Tensor | None, n_vocab: int) -> torch.Tensor:
    """Float logits [n, n_vocab] from draft_vocab_rows' outputs [n, N]: -inf outside the draft vocabulary,
    so penalties and warping see real token ids."""
    if vocab is None:
        return logits[:, :n_vocab].float()
    full = torch.full((logits.shape[0], n_vocab), float("-inf"), device=logits.device)
    full[:, vocab] = logits.float()
    return full
