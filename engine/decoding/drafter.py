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

from speclens.engine.decoding.sampling import SamplingParams


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


@dataclass(frozen=True)
class StepCost:
    """What a decoding step costs by how many drafted tokens it verifies: costs[n] for n = 0 .. len - 1 (any
    unit), non-decreasing and convex (each token adds at least what the one before it added); past the end
    each further token adds the last difference. Convexity makes worthwhile_count's greedy rule the best
    count and worth_floor a true floor; real forwards are convex enough: flat while the cores wait on
    memory, then a row of arithmetic each."""

    costs: tuple[float, ...]

    def __post_init__(self) -> None:
        c = self.costs
        steps = [b - a for a, b in zip(c, c[1:])]
        convex = all(e >= d - 1e-12 * c[-1] for d, e in zip(steps, steps[1:]))  # rounding in StepCost.measured
        if len(c) < 2 or c[0] <= 0 or any(d < 0 for d in steps) or not convex:
            raise ValueError(f"a step cost needs 2 or more positive, non-decreasing, convex costs, got {c}")

    @classmethod
    def linear(cls, rows: float) -> StepCost:
        """rows + n: the step costs `rows` rows besides its n tokens (drafting, the root's row, overhead)."""
        if not rows > 0:
            raise ValueError(f"a step's rows must be positive, got {rows}")
        return cls((float(rows), rows + 1.0))

    @classmethod
    def measured(cls, seconds: Sequence[float]) -> StepCost:
        """From timed forwards over 1, 2, 3 ... tokens (seconds[n]: a step verifying n drafted tokens): made
        non-decreasing (timing noise), then the lower convex hull of those points."""
        rising = [max(seconds[: n + 1]) for n in range(len(seconds))]
        hull: list[int] = []  # indices of the hull's corners
        for n in range(len(rising)):
            while len(hull) >= 2 and ((rising[hull[-1]] - rising[hull[-2]]) * (n - hull[-2])
                                      >= (rising[n] - rising[hull[-2]]) * (hull[-1] - hull[-2])):
                hull.pop()
            hull.append(n)
        costs = [rising[0]]
        for a, b in zip(hull, hull[1:]):
            costs += [rising[a] + (rising[b] - rising[a]) * (n - a) / (b - a) for n in range(a + 1, b + 1)]
        return cls(tuple(costs))

    def __call__(self, n: int) -> float:
        last = len(self.costs) - 1
        return self.costs[n] if n <= last else self.costs[-1] + (n - last) * (self.costs[-1] - self.costs[-2])


def worthwhile_count(values: Sequence[float], cost: StepCost) -> int:
    """How many of the drafted tokens, valued in descending order (how likely each is to be accepted),
    are worth verifying when a step verifying n of them costs cost(n): a step emits E = 1 + (the sum of
    the kept values) tokens, and the next token is kept while it raises E / cost, that is while its value
    exceeds E / cost(kept) times what it adds to the cost. For a given count the most valuable tokens are
    best, and with values falling and costs convex E / cost rises and then falls, so the count is the best."""
    expected, kept = 1.0, 0
    for value in values:
        if value * cost(kept) <= expected * (cost(kept + 1) - cost(kept)):
            break
        expected, kept = expected + value, kept + 1
    return kept


def worth_floor(cost: StepCost | None) -> float:
    """The value at or below which worthwhile_count keeps nothing (E / cost starts at 1 / cost(0), only
    rises, and each token adds at least cost(1) - cost(0)): a dynamic tree need not draft below such
    nodes. 0 without a cut."""
    return 0.0 if cost is None else (cost(1) - cost(0)) / cost(0)


