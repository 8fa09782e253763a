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


def tree_children(parents: list[int]) -> list[list[int]]:
    """children[i]: the nodes whose parent is i, in index order (= the order siblings are tried).

    parents: [N] with parents[0] = -1 (node 0 is the root) and parents[i] < i for i > 0.
    """
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if node == 0:
            if parent != -1:
                raise ValueError("node 0 must be the root (parent -1)")
            continue
        if not 0 <= parent < node:
            raise ValueError(f"node {node} has parent {parent}: parents must come before their children")
        children[parent].append(node)
    return children


def verify_tree(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tree_tokens: torch.Tensor,
    parents: list[int],
    generator: torch.Generator | None = None,
    without_replacement: bool = False,
) -> tuple[list[int], int]:
    """Multi-candidate rejection sampling down a token tree (SpecInfer / SpecTr).

    target_probs: [N, V] target distribution of the token after each node (given its ancestor path).
    draft_probs:  [N, V] row i = the draft distribution q node i was drawn from at its parent (row 0
                  is unused); None for deterministic children (one-hot q, e.g. top-k of a drafter).
    tree_tokens:  [N] long, node 0 = the last committed token.
    parents:      [N], parents[0] = -1, parents[i] < i; siblings are tried in index order.
    without_replacement: siblings were drawn one after another from q with the earlier siblings
                  removed (torch.multinomial(q, n, replacement=False)); the j-th sibling's q is then
                  q with siblings 1..j-1 zeroed and renormalised. False: siblings are i.i.d. draws of q.

    At a node with target row p: for each child c in order, with q_c the distribution c was drawn
    from, accept c with probability min(1, p(c) / q_c(c)) and descend; on rejection set
    p <- norm(max(0, p - q_c)) and try the next sibling. If every child is rejected, or the node is
    a leaf, emit a sample of the current p. Each step's residual is independent of which sibling
    was drawn, so by induction over siblings the emitted token is distributed exactly as p.

    Returns (path, next_token): path = accepted node indices from depth 1 down (root excluded).
    """
    n_nodes = tree_tokens.shape[0]
    if target_probs.shape[0] != n_nodes or (draft_probs is not None and draft_probs.shape[0] != n_nodes):
        raise ValueError(
            f"shape mismatch: target_probs {tuple(target_probs.shape)}, tree_tokens {tuple(tree_tokens.shape)}, "
            f"draft_probs {None if draft_probs is None else tuple(draft_probs.shape)}"
        )
    children = tree_children(parents)
    tokens = tree_tokens.tolist()
    path: list[int] = []
    node = 0
    while True:
        p_target = target_probs[node].double()  # [V], the residual after each rejected sibling
        tried: list[int] = []  # tokens of the siblings rejected so far
        accepted = None
        for child in children[node]:
            token = tokens[child]
            p_draft = _sibling_draft_row(draft_probs, child, token, tried, without_replacement, p_target)
            u = torch.rand((), generator=generator, dtype=torch.float64, device=p_target.device)
            # u < p/q written without the division: q = 0 accepts whenever p > 0, p = 0 never accepts.
            if bool(u * p_draft[token] < p_target[token]):
                accepted = child
                break
            p_target = _residual(p_target, p_draft)
            tried.append(token)
        if accepted is None:
            return path, _draw(p_target, generator)
        path.append(accepted)
        node = accepted


def verify_tree_greedy(target_argmax: torch.Tensor, tree_tokens: torch.Tensor, parents: list[int]) -> tuple[list[int], int]:
    """Temperature 0: follow the child whose token is the target's argmax, then emit its argmax.

    target_argmax: [N] long (argmax of each node's target row); tree_tokens: [N] long.
    Returns (path, next_token) as verify_tree: the longest root path matching greedy decoding.
    """
    children = tree_children(parents)
    tokens = tree_tokens.tolist()
    best = target_argmax.tolist()
    path: list[int] = []
    node = 0
    while True:
        match = next((c for c in children[node] if tokens[c] == best[node]), None)
        if match is None:
            return path, best[node]
        path.append(match)
        node = match


def _sibling_draft_row(
    draft_probs: torch.Tensor | None,
    child: int,
    token: int,
    tried: list[int],
    without_replacement: bool,
    like: torch.Tensor,
) -> torch.Tensor:
    """[V] float64: the distribution this sibling was actually drawn from."""
    if draft_probs is None:
        one_hot = torch.zeros_like(like)
        one_hot[token] = 1.0
        return one_hot
    q = draft_probs[child].to(like)
    if without_replacement and tried:
        q = q.clone()
        q[tried] = 0.0
        total = q.sum()
        q = q / total if total > 0 else q
    return q


def _residual(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) as unnormalised weights; p itself if rounding left nothing."""
    residual = (p_target - p_draft).clamp_(min=0.0)
    if residual.sum() <= 0:
        # Only reachable through rounding when p == q (then rejection has probability ~0).
        return p_target
    return residual / residual.sum()
