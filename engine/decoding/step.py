"""One chain speculative step: draft up to k tokens, verify them in one target forward, commit.
A plain step is the same with an empty draft."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speclens.engine.decoding.drafter import Draft, Drafter, empty_draft
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.decoding.verify import verify_chain, verify_chain_greedy
from speclens.engine.runtime.cache import CachedModel


@dataclass(frozen=True)
class StepResult:
    tokens: list[int]  # committed by this step: accepted drafts, then the correction or bonus
    drafted: int
    accepted: int
    p_target: list[float]  # per emitted token, under its target row
    p_draft: list[float | None]  # per emitted token, under its draft row (None past the draft)
    draft_s: float
    verify_s: float
    proposers: tuple[str | None, ...] = ()  # per emitted token: who drafted it (None: the target's own)


def speculative_step(
    target: CachedModel,
    drafter: Drafter | None,
    ids: list[int],
    k: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> StepResult:
    """Draft, verify, accept or resample, commit. With no drafter this is one plain decoding step."""
    t0 = time.perf_counter()
    draft = drafter.propose(ids, k, params, generator) if drafter else empty_draft(target.device)
    block = draft.tokens.tolist()
    draft_tokens = draft.tokens.to(target.device)  # [n_draft]
    n_draft = len(draft)
    t1 = time.perf_counter()

    logits = target.forward(ids, block, n_logits=n_draft + 1)  # [n_draft+1, V]
    # only the repetition penalty reads the history: skip an O(context) copy per step without it
    history = torch.tensor(ids, device=target.device) if params.repetition_penalty != 1.0 else draft_tokens[:0]
    scores = process_logits(logits, params, history, draft_tokens)  # [n_draft+1, V]
    if params.greedy:
        n_accepted, next_token = verify_chain_greedy(scores.argmax(-1), draft_tokens)
    else:
        p_target = scores.softmax(-1)
        p_draft = _draft_rows(draft, p_target.shape[-1], target.device)  # [n_draft, V]
        n_accepted, next_token = verify_chain(p_target, p_draft, draft_tokens, generator)
    t2 = time.perf_counter()

    tokens = draft_tokens[:n_accepted].tolist() + [next_token]
    committed = ids + tokens
    target.truncate(len(committed) - 1)  # the cache holds everything but the newest token
    if drafter:
        drafter.commit(committed)

    rows = torch.arange(len(tokens), device=target.device)
    token_ids = torch.tensor(tokens, device=target.device)
    if params.greedy:  # the emitted rows only, not the whole [n_draft+1, V] block
        p_target = scores[: len(tokens)].softmax(-1)
    pt = p_target[rows, token_ids].tolist()
    n_rows = min(len(tokens), n_draft)
    if draft.probs is None:  # a deterministic draft token has probability 1, any other token 0
        pd = [float(t == d) for t, d in zip(tokens, block)]
    else:
        pd = draft.probs[rows[:n_rows].to(draft.probs.device), token_ids[:n_rows].to(draft.probs.device)].tolist()
    pd += [None] * (len(tokens) - n_rows)
    proposers = ((drafter.name,) * n_accepted + (None,)) if drafter else (None,)
    return StepResult(tokens, n_draft, n_accepted, pt, pd, t1 - t0, t2 - t1, proposers)


def _draft_rows(draft: Draft, vocab: int, device: torch.device) -> torch.Tensor:
    """[n_draft, V] draft distributions; one-hot rows for deterministic drafts."""
    if draft.probs is not None:
        return draft.probs.to(device)
    return torch.nn.functional.one_hot(draft.tokens.to(device), vocab).float()
