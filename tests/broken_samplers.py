"""Deliberately broken chain verifiers: the exactness checks must reject each, or they prove nothing."""

from __future__ import annotations

import torch


def _accept_prefix(p_target, p_draft, draft_tokens, generator):
    k = draft_tokens.shape[0]
    rows = torch.arange(k)
    p = p_target[rows, draft_tokens]
    q = p_draft[rows, draft_tokens]
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    ok = (u * q < p).tolist()
    return next((i for i, a in enumerate(ok) if not a), k)


def _finish(n, p_target, draft_tokens, weights, generator, bonus_row=None):
    k = draft_tokens.shape[0]
    if n == k:
        row = p_target[k if bonus_row is None else bonus_row]
        return k, int(torch.multinomial(row, 1, generator=generator))
    return n, int(torch.multinomial(weights, 1, generator=generator))


def residual_softmax(p_target, p_draft, draft_tokens, generator=None):
    """Normalises the residual with a softmax instead of dividing by its sum."""
    n = _accept_prefix(p_target, p_draft, draft_tokens, generator)
    k = draft_tokens.shape[0]
    weights = (p_target[min(n, k)] - p_draft[min(n, k - 1)]).clamp(min=0).softmax(-1) if n < k else None
    return _finish(n, p_target, draft_tokens, weights, generator)


def residual_unclamped(p_target, p_draft, draft_tokens, generator=None):
    """Forgets max(0, .): negative residual entries end up as weight (through abs)."""
    n = _accept_prefix(p_target, p_draft, draft_tokens, generator)
    weights = (p_target[n] - p_draft[n]).abs() if n < draft_tokens.shape[0] else None
    return _finish(n, p_target, draft_tokens, weights, generator)


def resample_from_target(p_target, p_draft, draft_tokens, generator=None):
    """After a rejection samples from p_target instead of the residual."""
    n = _accept_prefix(p_target, p_draft, draft_tokens, generator)
    weights = p_target[n] if n < draft_tokens.shape[0] else None
    return _finish(n, p_target, draft_tokens, weights, generator)


def bonus_from_last_draft_row(p_target, p_draft, draft_tokens, generator=None):
    """Draws the bonus token from target row K-1 instead of row K."""
    n = _accept_prefix(p_target, p_draft, draft_tokens, generator)
    k = draft_tokens.shape[0]
    weights = (p_target[n] - p_draft[n]).clamp(min=0) if n < k else None
    return _finish(n, p_target, draft_tokens, weights, generator, bonus_row=k - 1)


def accept_by_target_prob(p_target, p_draft, draft_tokens, generator=None):
    """Scores drafts as if they were deterministic (accept with p, ignore q), residual correct."""
    k = draft_tokens.shape[0]
    rows = torch.arange(k)
    u = torch.rand(k, generator=generator, dtype=torch.float64)
    ok = (u < p_target[rows, draft_tokens]).tolist()
    n = next((i for i, a in enumerate(ok) if not a), k)
    weights = (p_target[n] - p_draft[n]).clamp(min=0) if n < k else None
    return _finish(n, p_target, draft_tokens, weights, generator)


BROKEN = [
    residual_softmax,
    residual_unclamped,
    resample_from_target,
    bonus_from_last_draft_row,
    accept_by_target_prob,
]
