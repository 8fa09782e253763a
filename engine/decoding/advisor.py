"""Speedup advisor: predict tokens/s for each draft length K from what was measured.

E(K) = 1 + sum_{i=1..K} P(the first i drafts are all accepted)   (tokens per target pass)
T(K) = K * t_draft + t_verify(K + 1)                              (seconds per step)
speedup(K) = (E(K) / T(K)) / (1 / t_verify(1))                    (against plain decoding)

P(first i accepted) is the product of the conditional acceptances at positions 1..i, each counted from
the steps and shrunk toward 1/2 by one pseudo-accept and one pseudo-reject (Laplace's rule): a short
answer whose few steps were all accepted says the acceptance is high, not that it is 1, which would
predict unbounded speedups at long K. Past the measured positions the last conditional acceptance
repeats (a geometric tail).

t_verify(n) takes its shape over n from the target's timed forwards when the engine measured them (on a
CPU, where each verified row costs arithmetic) and its level from the answer's own verify times; an
answer drafts mostly one length, so a line fitted to it alone has an unknown slope.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent


@dataclass(frozen=True)
class Costs:
    draft_s_per_token: float
    verify: StepCost  # seconds of a target pass over n drafted tokens and the root, n = 0, 1, ...

    @classmethod
    def line(cls, draft_s_per_token: float, verify_base_s: float, verify_per_token_s: float) -> Costs:
        """t_verify(n tokens) = verify_base_s + verify_per_token_s * n."""
        one = verify_base_s + verify_per_token_s
        return cls(draft_s_per_token, StepCost((one, one + verify_per_token_s)))

    def verify_s(self, n_tokens: int) -> float:
        return self.verify(n_tokens - 1)


@dataclass(frozen=True)
class Advice:
    ks: tuple[int, ...]
    expected_tokens: tuple[float, ...]  # E(K) per K
    speedup: tuple[float, ...]  # predicted speedup over plain decoding per K
    best_k: int


def prefix_acceptance(per_position: Sequence[float], k: int) -> list[float]:
    """P(first i drafts accepted) for i = 1..k, extending the measured values geometrically."""
    measured = [min(max(a, 0.0), 1.0) for a in per_position]
    if not measured:
        return [0.0] * k
    ratio = measured[-1] / measured[-2] if len(measured) > 1 and measured[-2] > 0 else measured[-1]
    out = measured[:k]
    while len(out) < k:
        out.append(out[-1] * ratio)
    return out


def measured_acceptance(steps: Sequence[StepEvent]) -> list[float]:
    """P(first i drafts accepted), i = 1 .. the longest draft: products of conditional acceptances, each
    (accepted + 1) / (reached + 2) over the steps that drafted position i with the i - 1 before it accepted."""
    longest = max((s.drafted for s in steps), default=0)
    out, prefix = [], 1.0
    for i in range(longest):
        reached = sum(1 for s in steps if s.drafted > i and s.accepted >= i)
        accepted = sum(1 for s in steps if s.drafted > i and s.accepted > i)
        prefix *= (accepted + 1) / (reached + 2)
        out.append(prefix)
    return out


def expected_tokens(per_position: Sequence[float], k: int) -> float:
    return 1.0 + sum(prefix_acceptance(per_position, k))


def predict(per_position: Sequence[float], costs: Costs, k_max: int = 16, drafting_share: float = 1.0) -> Advice:
    """drafting_share: the fraction of steps where the drafter proposed anything (prompt lookup
    often finds no match); the other steps emit one token, so E(K) shrinks to 1 + share * (E - 1)."""
    ar_rate = 1.0 / costs.verify_s(1)
    ks = tuple(range(1, k_max + 1))
    expected = tuple(1.0 + drafting_share * (expected_tokens(per_position, k) - 1.0) for k in ks)
    def step_s(k: int) -> float:
        # a drafting step pays K draft steps and a K+1 verify; a step with no draft, a plain verify
        return drafting_share * (k * costs.draft_s_per_token + costs.verify_s(k + 1)) + (
            1.0 - drafting_share
        ) * costs.verify_s(1)

    speedup = tuple((e / step_s(k)) / ar_rate for k, e in zip(ks, expected))
    best = max(range(len(ks)), key=lambda i: speedup[i])
    return Advice(ks, expected, speedup, ks[best])


def measure_costs(steps: Sequence[StepEvent], shape: StepCost | None = None) -> Costs:
    """Draft cost per token, and the verify cost: `shape` (a forward over n drafted tokens, any unit, as
    Engine.lookup_cost) scaled by least squares to the steps' verify times; without one, a straight line
    fitted to them (flat when every step verified the same number of tokens)."""
    if not steps:
        raise ValueError("no steps measured")
    drafted = sum(s.drafted for s in steps)
    draft_s = sum(s.draft_s for s in steps) / drafted if drafted else 0.0
    ys = [s.verify_s for s in steps]
    if shape is not None:
        cs = [shape(s.drafted) for s in steps]
        scale = max(sum(c * y for c, y in zip(cs, ys)) / sum(c * c for c in cs), 1e-12)
        return Costs(draft_s, StepCost(tuple(scale * c for c in shape.costs)))
    xs = [s.drafted + 1 for s in steps]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var, 0.0) if var else 0.0
    base = max(mean_y - slope * mean_x, 1e-9)
    return Costs.line(draft_s, base, slope)


def drafting_share(steps: Sequence[StepEvent]) -> float:
    return sum(1 for s in steps if s.drafted) / len(steps) if steps else 0.0


def advise_steps(steps: Sequence[StepEvent], k_max: int = 16, shape: StepCost | None = None) -> Advice:
    """The prediction from one answer's chain steps (see the module's docstring)."""
    return predict(measured_acceptance(steps), measure_costs(steps, shape), k_max, drafting_share(steps))
