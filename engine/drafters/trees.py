"""Tree drafters: a draft model that proposes token trees, and a tree drafter that grafts the
lookup and datastore chains into another's trees."""

from __future__ import annotations

from dataclasses import replace

import torch

from speclens.engine.decoding.drafter import StepCost, worth_floor, worthwhile_count
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.decoding.tree import (
    DraftTree,
    TreeDrafter,
    TreeShape,
    graft_chain,
    keep_best,
    keep_worthwhile,
    tree_scores,
)
from speclens.engine.decoding.verify import tree_children
from speclens.engine.drafters.datastore import (
    STORE_ACCEPTANCE,
    STORE_BESIDE_A_TREE,
    STORE_BEST_BESIDE_A_TREE,
    Datastore,
    DatastoreDrafter,
)
from speclens.engine.drafters.lookup import PromptLookupDrafter, chain_acceptance, valued_lookup
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.masks import node_depths


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
