"""Drafters: one small interface, several implementations.

A drafter proposes up to k tokens that continue the committed ids, together with the distributions
it sampled them from (None for deterministic drafts, which verification treats as one-hot rows).
The decoding loop never special-cases a drafter kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

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
