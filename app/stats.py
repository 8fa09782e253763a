"""Per-answer statistics derived from StepEvents (pure Python, no Qt), for the plots, the diff and
the speedup advisor."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from speclens.engine.decoding.advisor import Advice, advise_steps
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent

ROLLING_STEPS = 16


@dataclass(frozen=True)
class StepSeries:
    """Arrays over verification steps, ready to plot (NaN where a value is undefined)."""

    steps: tuple[int, ...]
    acceptance: tuple[float, ...]  # accepted / drafted of that step
    rolling_acceptance: tuple[float, ...]  # over the last ROLLING_STEPS steps
    tokens_per_s: tuple[float, ...]  # rolling, over the last ROLLING_STEPS steps
    mean_accepted_length: tuple[float, ...]  # running tau = emitted so far / steps so far
    per_position: tuple[float, ...]  # P(draft i accepted | drafted), i = 0..max drafted-1
    histogram: tuple[int, ...]  # steps that accepted exactly n drafts, n = 0..max


def step_series(events: Sequence[StepEvent], window: int = ROLLING_STEPS) -> StepSeries:
    nan = float("nan")
    steps, acceptance, rolling, rate, tau = [], [], [], [], []
    emitted_total = 0
    max_drafted = max((e.drafted for e in events), default=0)
    drafted_at = [0] * max_drafted
    accepted_at = [0] * max_drafted
    histogram = [0] * (max((e.accepted for e in events), default=0) + 1)
    for i, e in enumerate(events):
        steps.append(e.step)
        acceptance.append(e.accepted / e.drafted if e.drafted else nan)
        recent = events[max(0, i - window + 1) : i + 1]
        drafted = sum(r.drafted for r in recent)
        rolling.append(sum(r.accepted for r in recent) / drafted if drafted else nan)
        # tokens over the last `window` steps' time, from the first decoding step on: the prefill is not
        # decoding, and counting it made every answer's curve ramp up (time to first token is shown apart)
        before = events[i - window] if i >= window else None
        dt = e.decode_s - (before.decode_s if before else 0.0)
        dn = e.new_tokens - (before.new_tokens if before else 0)
        rate.append(dn / dt if dt > 0 else nan)
        emitted_total += e.emitted
        tau.append(emitted_total / (i + 1))
        for p in range(e.drafted):
            drafted_at[p] += 1
            accepted_at[p] += p < e.accepted
        if e.drafted:
            histogram[e.accepted] += 1
    per_position = tuple(a / d if d else nan for a, d in zip(accepted_at, drafted_at))
    return StepSeries(
        tuple(steps), tuple(acceptance), tuple(rolling), tuple(rate), tuple(tau), per_position,
        tuple(histogram),
    )


@dataclass(frozen=True)
class TokenDiff:
    identical: bool
    left_changed: frozenset[int]  # token indices that differ, per side
    right_changed: frozenset[int]
    first_difference: int | None


def diff_tokens(left: Sequence[int], right: Sequence[int]) -> TokenDiff:
    """Token-level difference of two outputs (by token id, aligned with difflib)."""
    left_changed: set[int] = set()
    right_changed: set[int] = set()
    matcher = difflib.SequenceMatcher(None, list(left), list(right), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            left_changed.update(range(i1, i2))
            right_changed.update(range(j1, j2))
    first = next((i for i, (a, b) in enumerate(zip(left, right)) if a != b), None)
    if first is None and len(left) != len(right):
        first = min(len(left), len(right))
    return TokenDiff(
        identical=list(left) == list(right),
        left_changed=frozenset(left_changed),
        right_changed=frozenset(right_changed),
        first_difference=first,
    )


def advise(events: Sequence[StepEvent], k_max: int = 16, verify_shape: StepCost | None = None) -> Advice | None:
    """The speedup advisor's prediction from one answer's measured steps (acceptance per position and
    draft/verify timings; verify_shape: the loaded target's timed forwards, LoadInfo.verify_shape); None
    when nothing was drafted, so there is nothing to measure, and for token trees, whose passes verify
    more tokens than K (the advisor models chains)."""
    if not any(e.drafted for e in events) or any(e.tree for e in events):
        return None
    return advise_steps(events, k_max, verify_shape)


def speedup_at(advice: Advice, k: int) -> float:
    """The predicted speedup at draft length k, clamped to the advised range."""
    return advice.speedup[min(max(k, advice.ks[0]), advice.ks[-1]) - advice.ks[0]]
