"""Token trees: structure, static (Medusa-style) and dynamic (EAGLE-2-style) shapes, pruning by value,
and the tree speculative step (the tree drafters themselves live in speclens.engine.drafters.trees;
the attention mask and depths in speclens.engine.runtime.masks).

A tree is given by parent indices: node 0 is the root (the last committed token), parents[i] < i,
and siblings are tried in index order. One target forward scores every node: each node attends to
the committed prefix plus its own ancestors and sits at position (prefix length + depth), so its
logits equal those of the plain model run on prefix + its ancestor path. After verification only
the accepted path is kept in the KV cache (CachedModel.keep_tree_path).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from speclens.engine.decoding.drafter import StepCost, worthwhile_count
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.decoding.step import StepResult
from speclens.engine.decoding.verify import tree_children, verify_tree, verify_tree_greedy
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.masks import ancestor_path

# Medusa's small default-like shape: three candidates at depth 1, then mostly the top candidate.
DEFAULT_TREE_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0),
)
# A chain as a tree shape: the top candidate at every depth (truncate it to the draft length).
CHAIN_PATHS: tuple[tuple[int, ...], ...] = tuple((0,) * depth for depth in range(1, 17))


@dataclass(frozen=True)
class TreeShape:
    """A static tree as Medusa writes it: index paths such as [[0], [1], [0, 0], [0, 1], [1, 0]].

    Path (a, b) is the b-th best candidate below the a-th best candidate of the root. Nodes are
    numbered breadth first (root = 0), so parents come before children and siblings by rank.
    """

    paths: tuple[tuple[int, ...], ...]  # node i > 0 is paths[i - 1]
    parents: tuple[int, ...]  # [N]
    ranks: tuple[int, ...]  # [N] candidate rank of each node below its parent (root: 0)

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TreeShape:
        ordered = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
        if not ordered or any(len(p) == 0 or min(p) < 0 for p in ordered):
            raise ValueError("a tree shape is a non-empty list of non-empty paths of ranks >= 0")
        index = {(): 0}
        parents, ranks = [-1], [0]
        for path in ordered:
            if path[:-1] not in index:
                raise ValueError(f"path {list(path)} has no parent path {list(path[:-1])} in the shape")
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        for node, below in enumerate(tree_children(parents)):
            # siblings are drawn in rank order; a missing rank would hide a draw from verification
            if sorted(ranks[c] for c in below) != list(range(len(below))):
                raise ValueError(f"the children of {list(ordered[node - 1]) if node else 'the root'} "
                                 "must have ranks 0, 1, ... without gaps")
        return cls(tuple(ordered), tuple(parents), tuple(ranks))

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    def truncated(self, depth: int) -> TreeShape:
        return TreeShape.from_paths([p for p in self.paths if len(p) <= depth])


def select_by_value(parents: Sequence[int], values: Sequence[float], budget: int) -> list[int]:
    """EAGLE-2 reranking: the `budget` non-root nodes of highest value, as a sorted node list that
    always includes the root and is closed under ancestors.

    values are cumulative draft probabilities (product along the path), so a child never beats its
    parent; ties are broken towards lower indices, which keeps parents ahead of their children.
    """
    order = sorted(range(1, len(parents)), key=lambda i: (-values[i], i))
    kept = {0}
    for node in order:
        if len(kept) > budget:
            break
        if parents[node] in kept:
            kept.add(node)
    return sorted(kept)


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] long, node 0 = the last committed token
    parents: tuple[int, ...]  # [N], parents[0] = -1, parents[i] < i
    probs: torch.Tensor | None  # [N, V] q each node was drawn from at its parent; None: deterministic
    without_replacement: bool = False  # siblings were sampled from q without replacement
    proposers: tuple[str, ...] = ()  # [N] who drafted each node; "" (and ()): the tree's own drafter
    # [N] how likely each node is to be accepted, as its drafter estimates it (a dynamic tree's
    # cumulative draft probability); () where unknown. Only ranks nodes; exactness never reads it.
    values: tuple[float, ...] = ()

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@runtime_checkable
class TreeDrafter(Protocol):
    name: str

    def prefill(self, ids: list[int]) -> None: ...

    def propose_tree(
        self, ids: list[int], depth: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree:
        """A tree of depth <= depth below ids[-1] (LookupGraftedDrafter's chains keep their own lengths)."""

    def commit(self, ids: list[int]) -> None: ...


def tree_scores(logits: torch.Tensor, params: SamplingParams, ids: list[int], tokens: list[int],
                parents: Sequence[int]) -> torch.Tensor:
    """Processed logits [N, V] of every node; row i sees the history ids + its ancestor path."""
    device = logits.device
    if params.repetition_penalty == 1.0:
        # no history-dependent processing: one batched call (the block argument is unused)
        return process_logits(logits, params, torch.tensor(ids, device=device),
                              torch.zeros(len(tokens) - 1, dtype=torch.long, device=device))
    rows = []
    for node in range(len(tokens)):
        history = torch.tensor(ids + [tokens[i] for i in ancestor_path(parents, node)], device=device)
        rows.append(process_logits(logits[node : node + 1], params, history, history[:0]))
    return torch.cat(rows)  # [N, V]


def graft_chain(tree: DraftTree, chain: Sequence[int], proposer: str = "",
                chain_values: Sequence[float] = ()) -> DraftTree:
    """The deterministic tree with the token chain hung below its root, sharing any prefix the tree
    already holds: siblings stay distinct tokens, as multi-candidate verification requires. New
    nodes are credited to `proposer`; shared ones keep the proposer that drafted them first.

    Where both the tree and the call give values (per chain token: how likely the chain is right up
    to it), a new node takes its chain value and a shared node the larger of its two."""
    if tree.probs is not None:
        raise ValueError("only a deterministic tree can take a deterministic chain")
    tokens, parents = tree.tokens.tolist(), list(tree.parents)
    proposers = list(tree.proposers) or [""] * len(tokens)
    valued = bool(tree.values) and len(chain_values) == len(chain)
    values = list(tree.values) if valued else []
    children = tree_children(parents)
    node = 0
    for depth, token in enumerate(chain):
        same = [c for c in children[node] if tokens[c] == token]
        if same:
            node = same[0]
        else:
            tokens.append(token)
            parents.append(node)
            proposers.append(proposer)
            children.append([])
            children[node].append(len(tokens) - 1)
            node = len(tokens) - 1
            if valued:
                values.append(0.0)
        if valued:
            values[node] = max(values[node], chain_values[depth])
    return DraftTree(torch.tensor(tokens, device=tree.tokens.device), tuple(parents), None, tree.without_replacement,
                     tuple(proposers), tuple(values))


def keep_best(tree: DraftTree, budget: int) -> DraftTree:
    """The deterministic tree cut to its `budget` most valuable non-root nodes (closed under ancestors,
    select_by_value); a node is worth no more than its parent, since it is accepted only after it. A tree
    without values, or within the budget, is returned as it is."""
    if not tree.values or len(tree) <= budget + 1:
        return tree
    return _cut(tree, _capped_values(tree), budget)


def keep_worthwhile(tree: DraftTree, cost: StepCost) -> DraftTree:
    """The deterministic tree cut to the nodes worth verifying, when a step verifying n of them costs
    cost(n): its most valuable nodes, as many as worthwhile_count keeps (node values as acceptance
    probabilities).
    A node is worth no more than its parent, so the kept nodes are closed under ancestors. A tree without
    values, or whose every node is worth verifying, is returned as it is."""
    if not tree.values or len(tree) == 1:
        return tree
    values = _capped_values(tree)
    kept = worthwhile_count(sorted(values[1:], reverse=True), cost)
    return tree if kept == len(tree) - 1 else _cut(tree, values, kept)


def _capped_values(tree: DraftTree) -> list[float]:
    """The tree's node values, each at most its parent's (a node is accepted only after its parent)."""
    values = list(tree.values)
    for node in range(1, len(values)):
        values[node] = min(values[node], values[tree.parents[node]])
    return values


def _cut(tree: DraftTree, values: list[float], budget: int) -> DraftTree:
    """The tree's `budget` most valuable non-root nodes by the capped `values` (select_by_value)."""
    kept = select_by_value(tree.parents, values, budget)
    new_index = {old: new for new, old in enumerate(kept)}
    return DraftTree(tree.tokens[kept], tuple(new_index[tree.parents[i]] if i else -1 for i in kept), None,
                     tree.without_replacement, tuple(tree.proposers[i] for i in kept) if tree.proposers else (),
                     tuple(values[i] for i in kept))


def tree_step(target: CachedModel, drafter: TreeDrafter, ids: list[int], depth: int,
              params: SamplingParams, generator: torch.Generator | None):
    """Draft a tree, verify it in one target forward, accept a path or resample, commit.

    Returns a StepResult with drafted = the depths tried along the verified path
    (len(path) + 1 when the last accepted node had children, so accepted == drafted means bonus).
    """
    t0 = time.perf_counter()
    tree = drafter.propose_tree(ids, depth, params, generator)
    tokens = tree.tokens.tolist()
    parents = list(tree.parents)
    t1 = time.perf_counter()

    logits = target.forward_tree(ids, tokens, parents)  # [N, V], one target pass
    scores = tree_scores(logits, params, ids, tokens, parents)  # [N, V]
    tree_tokens = tree.tokens.to(target.device)
    if params.greedy:
        path, next_token = verify_tree_greedy(scores.argmax(-1), tree_tokens, parents)
    else:
        p_target = scores.softmax(-1)
        probs = None if tree.probs is None else tree.probs.to(target.device)
        path, next_token = verify_tree(p_target, probs, tree_tokens, parents, generator, tree.without_replacement)
    t2 = time.perf_counter()

    target.keep_tree_path(tokens, path)  # the cache now holds ids + the accepted tokens
    emitted = [tokens[node] for node in path] + [next_token]
    drafter.commit(ids + emitted)

    children = tree_children(parents)
    last = path[-1] if path else 0
    drafted = len(path) + (1 if children[last] else 0)
    nodes = [0, *path]  # the node whose target row scored each emitted token
    # greedy: normalise only the emitted tokens' rows, not the whole [N, V] tree
    rows = scores[nodes].softmax(-1) if params.greedy else p_target[nodes]  # [len(nodes), V]
    pt = [float(rows[i, token]) for i, token in enumerate(emitted)]
    pd: list[float | None] = []
    for node, token in zip(nodes, emitted):
        below = children[node]
        if not below:
            pd.append(None)
        elif tree.probs is None:
            pd.append(float(any(tokens[c] == token for c in below)))
        else:
            pd.append(float(tree.probs[below[0], token]))
    credited = tree.proposers or ("",) * len(tokens)  # "": the tree drafter's own node
    proposers = (*(credited[node] or drafter.name for node in path), None)
    return StepResult(emitted, drafted, len(path), pt, pd, t1 - t0, t2 - t1, proposers)
