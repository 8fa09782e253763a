"""Token trees: structure, tree attention, static (Medusa-style) and dynamic (EAGLE-2-style) shapes,
a draft-model tree drafter, and the tree speculative step.

A tree is given by parent indices: node 0 is the root (the last committed token), parents[i] < i,
and siblings are tried in index order. One target forward scores every node: each node attends to
the committed prefix plus its own ancestors and sits at position (prefix length + depth), so its
logits equal those of the plain model run on prefix + its ancestor path. After verification only
the accepted path is kept in the KV cache (CachedModel.keep_tree_path).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from engine.cache import CachedModel
from engine.drafters import StepCost, worth_floor, worthwhile_count
from engine.drafters.datastore import (STORE_ACCEPTANCE, STORE_BEST_BESIDE_A_TREE, STORE_BESIDE_A_TREE, Datastore,
                                      DatastoreDrafter)
from engine.drafters.lookup import PromptLookupDrafter, chain_acceptance, valued_lookup
from engine.sampling import SamplingParams, process_logits
from engine.verify import tree_children, verify_tree, verify_tree_greedy

# Medusa's small default-like shape: three candidates at depth 1, then mostly the top candidate.
DEFAULT_TREE_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (0, 0, 0, 0),
)
# A chain as a tree shape: the top candidate at every depth (truncate it to the draft length).
CHAIN_PATHS: tuple[tuple[int, ...], ...] = tuple((0,) * depth for depth in range(1, 17))


def node_depths(parents: Sequence[int]) -> list[int]:
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return depths


def ancestor_path(parents: Sequence[int], node: int) -> list[int]:
    """Nodes from depth 1 down to `node` (the root excluded)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_attention(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row i is True at i and at every ancestor of i (what node i may attend to)."""
    n = len(parents)
    rows: list[list[bool]] = []  # Python lists: a torch op per node cost 5x as much
    for node in range(n):
        row = rows[parents[node]].copy() if node else [False] * n
        row[node] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(n, n)


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


class DraftModelTreeDrafter:
    """A draft LM proposes a token tree, one draft forward per depth (tree attention over the
    partial tree).

    Static shape (Medusa-style ranks): at temperature 0 the children of a node are its top-r draft
    tokens (deterministic, verified as one-hot); at temperature > 0 they are r draws without
    replacement from the draft distribution. Dynamic (shape=None, EAGLE-2-style): at each depth the
    `top_k` frontier nodes of highest cumulative draft probability get their top_k tokens as
    children, then the `budget` best nodes are kept (deterministic children, verified as one-hot),
    and with `step_cost` only those of them worth verifying (keep_worthwhile).
    """

    def __init__(self, model: CachedModel, shape: TreeShape | None = None, top_k: int = 3,
                 budget: int = 16, name: str = "tree", step_cost: StepCost | None = None):
        self.lm = model
        self.shape = shape
        self.top_k = top_k
        self.budget = budget
        self.name = name
        self.step_cost = step_cost

    def prefill(self, ids: list[int]) -> None:
        self.lm.prefill(ids)

    def commit(self, ids: list[int]) -> None:
        self.lm.truncate(self.lm.common_prefix(ids))

    def propose_tree(
        self, ids: list[int], depth: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree:
        if self.shape is None:
            return self._dynamic(ids, depth, params)
        return self._static(ids, self.shape.truncated(depth), params, generator)

    def _draft_scores(self, ids: list[int], tokens: list[int], parents: list[int], nodes: list[int],
                      params: SamplingParams) -> torch.Tensor:
        """Processed draft logits [len(nodes), V] at the given nodes of the partial tree."""
        logits = self.lm.forward_tree(ids, tokens, parents)  # [N, V]
        return tree_scores(logits, params, ids, tokens, parents)[nodes]

    def _static(self, ids: list[int], shape: TreeShape, params: SamplingParams,
                generator: torch.Generator | None) -> DraftTree:
        tokens, parents, rows = [ids[-1]], [-1], [None]
        shape_to_tree = {0: 0}  # shape node -> tree node (a shape node may be dropped)
        shape_children = tree_children(list(shape.parents))
        shape_depth = node_depths(shape.parents)
        for d in range(shape.depth):
            expand = [s for s in shape_to_tree if shape_depth[s] == d and shape_children[s]]
            if not expand:
                break
            scores = self._draft_scores(ids, tokens, parents, [shape_to_tree[s] for s in expand], params)
            for s, score in zip(expand, scores):
                q = score.softmax(-1)  # [V]
                wanted = sorted(shape_children[s], key=lambda c: shape.ranks[c])
                n = min(max(shape.ranks[c] for c in wanted) + 1, int((q > 0).sum()))
                if params.greedy:
                    candidates = score.topk(n).indices.tolist()
                else:
                    candidates = torch.multinomial(q, n, replacement=False, generator=generator).tolist()
                for c in wanted:
                    if shape.ranks[c] < n:
                        shape_to_tree[c] = len(tokens)
                        tokens.append(candidates[shape.ranks[c]])
                        parents.append(shape_to_tree[s])
                        rows.append(q)
        return self._tree(tokens, parents, None if params.greedy else rows, without_replacement=True)

    def _top_candidates(self, ids: list[int], tokens: list[int], parents: list[int], nodes: list[int],
                        params: SamplingParams) -> list[list[tuple[float, int]]]:
        """Per node, its top_k (draft probability, token) pairs, most probable first."""
        candidates = []
        for score in self._draft_scores(ids, tokens, parents, nodes, params):
            q = score.softmax(-1)  # [V]
            top = q.topk(min(self.top_k, int((q > 0).sum())))
            candidates.append(list(zip(top.values.tolist(), top.indices.tolist())))
        return candidates

    def _dynamic(self, ids: list[int], depth: int, params: SamplingParams) -> DraftTree:
        tokens, parents, values = [ids[-1]], [-1], [1.0]
        frontier = [0]
        floor = worth_floor(self.step_cost)
        for _ in range(depth):
            grown = []
            for node, top in zip(frontier, self._top_candidates(ids, tokens, parents, frontier, params)):
                for prob, token in top:
                    grown.append(len(tokens))
                    tokens.append(token)
                    parents.append(node)
                    values.append(values[node] * prob)
            # a node's descendants are worth no more than it: below the floor they would all be cut
            frontier = [n for n in sorted(grown, key=lambda i: (-values[i], i))[: self.top_k] if values[n] > floor]
            # A descendant's value is at most its frontier ancestor's and it ranks after every present
            # node of equal value, so once `budget` present nodes are worth at least the best frontier
            # node, deeper levels cannot enter the kept tree: stop drafting them.
            ranked = sorted(values[1:], reverse=True)
            if not frontier or (len(ranked) >= self.budget and ranked[self.budget - 1] >= values[frontier[0]]):
                break
        tree = keep_best(self._tree(tokens, parents, None, False, tuple(values)), self.budget)
        return tree if self.step_cost is None else keep_worthwhile(tree, self.step_cost)

    def _tree(self, tokens: list[int], parents: list[int], rows: list | None, without_replacement: bool,
              values: tuple[float, ...] = ()) -> DraftTree:
        device = self.lm.device
        probs = None
        if rows is not None and len(tokens) > 1:
            probs = torch.stack([torch.zeros_like(rows[1]), *rows[1:]])  # [N, V], row 0 unused
        return DraftTree(torch.tensor(tokens, device=device), tuple(parents), probs, without_replacement, (), values)


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


class LookupGraftedDrafter:
    """A tree drafter whose deterministic trees also carry the lookup continuations.

    Prompt lookup costs nothing and is right where the answer repeats its context (extraction,
    summaries, code edits); a datastore of the target's earlier answers (engine.drafters.datastore)
    is right where it falls into its set phrases; a learned head is right elsewhere. With the lookup
    chains grafted into the head's tree, one target forward verifies all of them and the longest
    accepted path wins. Sampled trees (static shapes at temperature > 0) carry their draft
    distributions and are left as they are.

    A chain is `lookup_tokens` or `store_tokens` long (None: the draft depth). A lookup chain longer
    than the head's tree costs a few extra nodes and pays where the answer copies its context for
    many tokens; a datastore chain is a guess from set phrases and is right for only a token or two.
    So these trees can be deeper than the `depth` asked (the head's depth) and hold up to
    lookup_tokens + store_tokens nodes beyond the head's budget; near max_new_tokens the decoding loop
    emits only what it may, so the deepest nodes of the last step can be verified for nothing.

    With `step_cost`, the merged tree keeps the nodes worth verifying (keep_worthwhile): the head's
    nodes are worth their cumulative draft probability, a chain's its measured acceptance for the
    length of the tail it matched (LOOKUP_ACCEPTANCE; STORE_ACCEPTANCE times STORE_BESIDE_A_TREE, as
    the head already drafts what the datastore would have got right). Where each verified node costs
    nearly a full row of arithmetic (a CPU), a chain that copies from a strong match keeps its depth
    while a weak one gives way (README, "Choosing the tree's nodes").

    With `lookup_cost`, a step whose lookup chain is worth verifying on its own at that cost (as the
    `lookup` method would verify it) verifies that chain alone and skips the head: where drafting with the
    head costs about a row per pass (a CPU), its nodes beside a likely chain add less than they cost.
    """

    def __init__(self, base: TreeDrafter, name: str, store: Datastore | None = None,
                 lookup_tokens: int | None = None, store_tokens: int | None = None,
                 step_cost: StepCost | None = None, lookup_cost: StepCost | None = None):
        self.base = base
        self.name = name
        self.store = store
        self.lookup_tokens = lookup_tokens
        self.store_tokens = store_tokens
        self.step_cost = step_cost
        self.lookup_cost = lookup_cost

    def prefill(self, ids: list[int]) -> None:
        self.base.prefill(ids)

    def commit(self, ids: list[int]) -> None:
        self.base.commit(ids)

    def propose_tree(
        self, ids: list[int], depth: int, params: SamplingParams, generator: torch.Generator | None
    ) -> DraftTree:
        lookup_tokens = depth if self.lookup_tokens is None else self.lookup_tokens
        found, lookup_values = valued_lookup(ids, lookup_tokens)
        alone = worthwhile_count(lookup_values, self.lookup_cost) if self.lookup_cost is not None else 0
        if alone:
            root = DraftTree(torch.tensor(ids[-1:]), (-1,), None, values=(1.0,))
            return graft_chain(root, found[:alone], PromptLookupDrafter.name, lookup_values[:alone])
        tree = self.base.propose_tree(ids, depth, params, generator)
        if tree.probs is not None:
            return tree
        tree = replace(tree, proposers=("", *[self.base.name] * (len(tree) - 1)))
        # in this order: a node two proposers share is credited to the head, then to prompt lookup
        store_tokens = depth if self.store_tokens is None else self.store_tokens
        chains = {PromptLookupDrafter.name: (found, lookup_values)}
        # a node worth worth_floor(step_cost) or less is never kept, so a store chain that cannot beat that is not looked up
        if self.store is not None and STORE_BEST_BESIDE_A_TREE > worth_floor(self.step_cost):
            found, matched = self.store.continuation_match(ids, store_tokens)
            values = [STORE_BESIDE_A_TREE * v for v in chain_acceptance(STORE_ACCEPTANCE, matched, len(found))]
            chains[DatastoreDrafter.name] = (found, values)
        for proposer, (chain, values) in chains.items():
            if chain:
                tree = graft_chain(tree, chain, proposer, values)
        return tree if self.step_cost is None else keep_worthwhile(tree, self.step_cost)


def tree_step(target: CachedModel, drafter: TreeDrafter, ids: list[int], depth: int,
              params: SamplingParams, generator: torch.Generator | None):
    """Draft a tree, verify it in one target forward, accept a path or resample, commit.

    Returns engine.decode.StepResult with drafted = the depths tried along the verified path
    (len(path) + 1 when the last accepted node had children, so accepted == drafted means bonus).
    """
    from engine.decode import StepResult  # decode.py dispatches here, so import it lazily

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
