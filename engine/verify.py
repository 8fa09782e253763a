"""Exact verification of drafted tokens (pure functions, no model code).

Chain (Leviathan et al. 2023, Chen et al. 2023): accept draft x_i with probability
min(1, p_target_i(x_i) / p_draft_i(x_i)); at the first rejection emit a sample of
norm(max(0, p_target_i - p_draft_i)); if all K are accepted emit a bonus sample of p_target_K.
The emitted tokens are distributed exactly as the target's. Deterministic drafts pass one-hot
`draft_probs` rows: acceptance becomes p_target(x) and the residual is p_target with x removed.
"""

from __future__ import annotations

import torch


def verify_chain(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Modified rejection sampling over one drafted chain.

    target_probs: [K+1, V] target distributions at each block position (row K is the bonus row).
    draft_probs:  [K, V] the distributions the draft tokens were sampled from.
    draft_tokens: [K] long.
    Returns (n_accepted, next_token): next_token is the residual sample at the first rejection, or
    the bonus sample from row K when all K drafts are accepted.
    """
    k = draft_tokens.shape[0]
    if target_probs.shape[0] != k + 1 or draft_probs.shape[0] != k:
        raise ValueError(
            f"shape mismatch: target_probs {tuple(target_probs.shape)}, "
            f"draft_probs {tuple(draft_probs.shape)}, draft_tokens {tuple(draft_tokens.shape)}"
        )
    rows = torch.arange(k, device=draft_tokens.device)
    p_target = target_probs[rows, draft_tokens].double()  # [K]
    p_draft = draft_probs[rows, draft_tokens].double()  # [K]
    u = torch.rand(k, generator=generator, dtype=torch.float64, device=p_target.device)  # [0, 1)
    # u < p/q written without the division: robust to q = 0, and p = 0 is never accepted.
    accepted = (u * p_draft < p_target).tolist()
    n = next((i for i, ok in enumerate(accepted) if not ok), k)
    if n == k:
        return k, _draw(target_probs[k], generator)
    residual = (target_probs[n].double() - draft_probs[n].double()).clamp_(min=0.0)  # [V]
    if residual.sum() <= 0:
        # Only reachable through rounding when p == q (then rejection has probability ~0).
        residual = target_probs[n].double()
    return n, _draw(residual, generator)


def verify_chain_greedy(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: accept while the target's argmax equals the draft, then emit its argmax.

    target_argmax: [K+1] long (argmax of each target row); draft_tokens: [K] long.
    """
    k = draft_tokens.shape[0]
    matches = (target_argmax[:k] == draft_tokens).tolist()
    n = next((i for i, ok in enumerate(matches) if not ok), k)
    return n, int(target_argmax[n])


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One sample from non-negative, not necessarily normalised weights [V]."""
    return int(torch.multinomial(weights, 1, generator=generator))
