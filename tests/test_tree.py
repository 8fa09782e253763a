from dataclasses import replace

import pytest
import torch

import speclens.engine.decoding.verify as verify_module
from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.drafter import StepCost, worth_floor
from speclens.engine.decoding.events import StepEvent, Summary, TokenEvent
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.decoding.tree import DraftTree, TreeShape, graft_chain, keep_best, keep_worthwhile, select_by_value
from speclens.engine.decoding.verify import verify_tree, verify_tree_greedy
from speclens.engine.drafters.datastore import STORE_ACCEPTANCE, STORE_BESIDE_A_TREE, Datastore
from speclens.engine.drafters.lookup import chain_acceptance, lookup_match
from speclens.engine.drafters.trees import DraftModelTreeDrafter, LookupGraftedDrafter
from speclens.engine.runtime.cache import TREE_SLOT, CachedModel
from speclens.engine.runtime.masks import ancestor_path, node_depths, tree_attention
from speclens.engine.tools.selftest import check_tree_exactness
from tests.tiny import assert_cache_matches_fresh_prefill, hf_greedy, tiny_llama, tiny_tokenizer

PROMPT = "one two three four five six one two three four"
MEDUSA_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


# --- exact multi-candidate verification ------------------------------------------------------


@pytest.mark.parametrize(
    "mode, branching",
    [("independent", (3, 2, 2)), ("without_replacement", (2, 3, 2)), ("deterministic", (3, 3))],
)
def test_verify_tree_is_exact(mode, branching):
    result = check_tree_exactness(verify_tree, branching=branching, draft_mode=mode, trials=65_536, seed=1)
    assert result.passed, result.describe()


def _keep_target_row(p_target, p_draft):
    return p_target


def _softmax_residual(p_target, p_draft):
    return (p_target - p_draft).clamp(min=0).softmax(-1)


def _unclamped_residual(p_target, p_draft):
    return (p_target - p_draft).abs() / (p_target - p_draft).abs().sum()


@pytest.mark.parametrize("residual", [_keep_target_row, _softmax_residual, _unclamped_residual],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("mode", ["independent", "deterministic"])
def test_exactness_check_rejects_broken_sibling_residual(monkeypatch, residual, mode):
    # _keep_target_row: p is not updated after a sibling is rejected.
    monkeypatch.setattr(verify_module, "_residual", residual)
    result = check_tree_exactness(verify_tree, branching=(3, 2), draft_mode=mode, trials=8192, seed=2)
    assert not result.passed, result.describe()


def test_exactness_check_rejects_ignoring_draws_without_replacement():
    def siblings_as_iid(*args, without_replacement=False, **kwargs):
        return verify_tree(*args, without_replacement=False, **kwargs)

    result = check_tree_exactness(siblings_as_iid, branching=(3, 2), draft_mode="without_replacement",
                                  trials=8192, seed=2)
    assert not result.passed, result.describe()


def test_deterministic_siblings_hand_computed():
    # Root row p = (0.5, 0.3, 0.2); one-hot children tokens 0 then 1 (both leaves).
    # P(accept 0) = 0.5; else p -> (0, 0.6, 0.4): P(accept 1) = 0.3; else emit token 2.
    p_target = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0, 0], [0, 0, 1.0]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    outcomes = []
    for _ in range(6000):
        path, token = verify_tree(p_target, None, torch.tensor([9, 0, 1]), [-1, 0, 0], gen)
        outcomes.append((tuple(path), token))
    share = {key: outcomes.count(key) / len(outcomes) for key in set(outcomes)}
    assert set(share) == {((1,), 0), ((2,), 2), ((), 2)}
    assert share[((1,), 0)] == pytest.approx(0.5, abs=0.03)  # accepted child 1, bonus from its row
    assert share[((2,), 2)] == pytest.approx(0.3, abs=0.03)
    assert share[((), 2)] == pytest.approx(0.2, abs=0.03)


def test_tree_shape_errors():
    with pytest.raises(ValueError):
        verify_tree(torch.ones(3, 4) / 4, None, torch.tensor([0, 1]), [-1, 0])
    with pytest.raises(ValueError):
        verify_tree(torch.ones(2, 4) / 4, None, torch.tensor([0, 1]), [-1, 1])  # parent after child
    with pytest.raises(ValueError):
        TreeShape.from_paths([[0], [0, 1]])  # rank 1 without rank 0
    with pytest.raises(ValueError):
        TreeShape.from_paths([[1, 0], [0]])  # no path [1]


def test_greedy_tree_verification():
    # root -> (5, 6); 5 -> (7,); 6 -> (8,)
    parents = [-1, 0, 0, 1, 2]
    tokens = torch.tensor([0, 5, 6, 7, 8])
    assert verify_tree_greedy(torch.tensor([6, 0, 8, 0, 3]), tokens, parents) == ([2, 4], 3)
    assert verify_tree_greedy(torch.tensor([5, 9, 8, 0, 3]), tokens, parents) == ([1], 9)
    assert verify_tree_greedy(torch.tensor([4, 9, 8, 0, 3]), tokens, parents) == ([], 4)


# --- tree structure ----------------------------------------------------------------------------


def test_graft_chain_shares_prefixes_and_keeps_siblings_distinct():
    tree = DraftTree(torch.tensor([5, 1, 2, 3]), (-1, 0, 0, 1), None)  # 5 -> {1 -> 3, 2}
    shared = graft_chain(tree, [1, 3, 7])  # follows 1 -> 3, adds 7 below 3
    assert shared.tokens.tolist() == [5, 1, 2, 3, 7] and shared.parents == (-1, 0, 0, 1, 3)
    new = graft_chain(tree, [9, 9])  # a new branch at the root
    assert new.tokens.tolist() == [5, 1, 2, 3, 9, 9] and new.parents == (-1, 0, 0, 1, 0, 4)
    for grafted in (shared, new):
        children = {}
        for node, parent in enumerate(grafted.parents[1:], start=1):
            children.setdefault(parent, []).append(grafted.tokens[node].item())
        assert all(len(set(c)) == len(c) for c in children.values())
    with pytest.raises(ValueError, match="deterministic"):
        graft_chain(DraftTree(tree.tokens, tree.parents, torch.ones(4, 10) / 10), [1])


def test_graft_chain_credits_new_nodes_to_their_proposer():
    tree = DraftTree(torch.tensor([0, 1, 2, 3]), (-1, 0, 0, 1), None, proposers=("", "eagle", "eagle", "eagle"))
    grafted = graft_chain(graft_chain(tree, [1, 3, 7], "lookup"), [2, 5], "rest")
    by_token = dict(zip(grafted.tokens.tolist(), grafted.proposers))
    assert by_token == {0: "", 1: "eagle", 2: "eagle", 3: "eagle", 7: "lookup", 5: "rest"}  # shared nodes keep theirs
    assert graft_chain(DraftTree(torch.tensor([0]), (-1,), None), [4], "lookup").proposers == ("", "lookup")


def test_graft_chain_values_new_nodes_by_the_chain_and_shared_ones_by_the_larger():
    tree = DraftTree(torch.tensor([5, 1, 2, 3]), (-1, 0, 0, 1), None, values=(1.0, 0.6, 0.3, 0.2))
    grafted = graft_chain(tree, [2, 8, 9], "lookup", [0.5, 0.4, 0.1])
    assert grafted.tokens.tolist() == [5, 1, 2, 3, 8, 9]
    assert grafted.values == (1.0, 0.6, 0.5, 0.2, 0.4, 0.1)
    assert graft_chain(tree, [2, 8], "lookup").values == ()  # a chain without values leaves the tree unranked


def test_keep_best_keeps_the_most_valuable_nodes_closed_under_ancestors():
    # 0 -> {1 -> 3 -> 5, 2 -> 4}; node 5's value exceeds its parent's, so it counts as its parent's
    tree = DraftTree(torch.tensor([7, 1, 2, 3, 4, 5]), (-1, 0, 0, 1, 2, 3), None,
                     proposers=("", "eagle", "lookup", "eagle", "lookup", "eagle"), values=(1.0, 0.9, 0.5, 0.4, 0.45, 0.8))
    best = keep_best(tree, 3)
    assert best.tokens.tolist() == [7, 1, 2, 4] and best.parents == (-1, 0, 0, 2)
    assert best.proposers == ("", "eagle", "lookup", "lookup") and best.values == (1.0, 0.9, 0.5, 0.45)
    assert keep_best(tree, 4).tokens.tolist() == [7, 1, 2, 3, 4]  # node 5 (worth 0.4 after its parent) is last
    unranked = replace(tree, values=())
    assert keep_best(tree, 5) is tree and keep_best(unranked, 2) is unranked


def _ancestor_closed_subsets(parents):
    """Every set of non-root nodes closed under ancestors (small trees only)."""
    nodes = range(1, len(parents))
    for mask in range(2 ** (len(parents) - 1)):
        kept = {n for i, n in enumerate(nodes) if mask >> i & 1}
        if all(parents[n] == 0 or parents[n] in kept for n in kept):
            yield kept


def test_keep_worthwhile_keeps_the_nodes_that_maximise_tokens_per_cost():
    """Against brute force: E / T = (1 + sum of kept values) / cost(kept nodes) is the best any
    ancestor-closed subset reaches, with each node worth no more than its parent: for linear costs (rows
    besides the nodes) and convex ones with flat stretches (measured forwards)."""
    generator = torch.Generator().manual_seed(0)
    cut_some = 0
    for trial in range(300):
        n = int(torch.randint(2, 9, (1,), generator=generator))
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]
        raw = [1.0] + torch.rand(n - 1, generator=generator).tolist()
        tree = DraftTree(torch.arange(n), tuple(parents), None, values=tuple(raw))
        capped = list(raw)
        for node in range(1, n):
            capped[node] = min(capped[node], capped[parents[node]])
        flat = StepCost((1.0, 1.0, 1.0, 1.2, 1.6, 2.4))
        for cost in (StepCost.linear(0.5), StepCost.linear(1.5), StepCost.linear(3.0), StepCost.linear(8.0), flat):
            best = max((1 + sum(capped[i] for i in kept)) / cost(len(kept)) for kept in _ancestor_closed_subsets(parents))
            cut = keep_worthwhile(tree, cost)
            kept = cut.tokens[1:].tolist()  # token i is node i
            got = (1 + sum(capped[i] for i in kept)) / cost(len(kept))
            assert got == pytest.approx(best, rel=1e-12), (parents, raw, cost)
            assert all(capped[i] > worth_floor(cost) for i in kept)  # nothing at or below the floor
            assert cut.parents[0] == -1 and all(p < i for i, p in enumerate(cut.parents) if i)
            cut_some += 1 < len(cut) < n
    assert cut_some > 100  # most cuts are partial, so the optimum is tested between the extremes
    unranked = DraftTree(torch.arange(3), (-1, 0, 1), None)
    assert keep_worthwhile(unranked, StepCost.linear(1.0)) is unranked and worth_floor(None) == 0.0


class _UnlikelyHead:  # a deterministic dynamic tree of four unlikely nodes below the root
    name = "head"

    def propose_tree(self, ids, depth, params, generator):
        return DraftTree(torch.tensor([ids[-1], 30, 31, 32, 33]), (-1, 0, 0, 1, 2), None,
                         values=(1.0, 0.2, 0.1, 0.05, 0.01))


def test_lookup_grafted_drafter_keeps_the_merged_nodes_worth_verifying():
    ids = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # the tail 1 2 3 matched 3 tokens: a strong lookup chain 4 5 6 1 2 3
    full = LookupGraftedDrafter(_UnlikelyHead(), "grafted", lookup_tokens=6).propose_tree(ids, 4, SamplingParams(), None)
    assert len(full) == 11
    def cut(step_rows):
        drafter = LookupGraftedDrafter(_UnlikelyHead(), "grafted", lookup_tokens=6, step_cost=StepCost.linear(step_rows))
        return drafter.propose_tree(ids, 4, SamplingParams(), None)
    # chain values 0.86 0.75 0.68 0.55 0.50 0.48 (LOOKUP_ACCEPTANCE[3]); at 4 rows a step the sixth
    # (0.48) no longer pays: E / T after five nodes is 4.34 / 9 = 0.482
    assert cut(4.0).tokens.tolist() == [3, 4, 5, 6, 1, 2] and cut(4.0).proposers == ("", *["lookup"] * 5)
    assert cut(12.0).tokens.tolist() == [3, 4, 5, 6, 1, 2, 3]  # the whole chain; the head's 0.2 < 4.82 / 18
    widest = cut(20.0)  # the head's best node (0.2 > 4.82 / 26), not its second (0.1 < 5.02 / 27)
    assert widest.tokens.tolist() == [3, 30, 4, 5, 6, 1, 2, 3] and widest.parents == (-1, 0, 0, 2, 3, 4, 5, 6)
    assert widest.proposers == ("", "head", *["lookup"] * 6)


class _CountingHead(_UnlikelyHead):
    def __init__(self):
        self.asked = 0

    def propose_tree(self, ids, depth, params, generator):
        self.asked += 1
        return super().propose_tree(ids, depth, params, generator)


def test_lookup_grafted_drafter_skips_the_head_where_lookup_alone_is_worth_verifying():
    """With a lookup cost, a lookup chain worth verifying on its own at that cost (worthwhile_count over
    LOOKUP_ACCEPTANCE, as the lookup method cuts it) is verified alone, without asking the head."""
    head = _CountingHead()
    drafter = LookupGraftedDrafter(head, "grafted", lookup_tokens=6, step_cost=StepCost.linear(4.0),
                                   lookup_cost=StepCost.linear(2.5))
    strong = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # 3 tokens matched: 0.86 0.75 0.68 0.55 0.50 0.48
    tree = drafter.propose_tree(strong, 4, SamplingParams(), None)
    assert head.asked == 0
    # at 2.5 rows the fourth (0.55) no longer pays: E / T after three nodes is 3.29 / 5.5 = 0.598
    assert tree.tokens.tolist() == [3, 4, 5, 6] and tree.parents == (-1, 0, 1, 2)
    assert tree.proposers == ("", *["lookup"] * 3) and tree.probs is None
    assert tree.values == (1.0, 0.86, 0.75, 0.68)
    two = [7, 8, 1, 2, 9, 5, 1, 2]  # the tail 1 2 matched 2 tokens: 0.53 > 1 / 2.5, worth it alone
    assert drafter.propose_tree(two, 4, SamplingParams(), None).tokens.tolist() == [2, 9] and head.asked == 0
    without = LookupGraftedDrafter(head, "grafted", lookup_tokens=6, step_cost=StepCost.linear(4.0))  # always asked
    assert without.propose_tree(strong, 4, SamplingParams(), None).tokens.tolist() == [3, 4, 5, 6, 1, 2]
    assert head.asked == 1
    weak = [7, 1, 9, 5, 1]  # 1 token matched: 0.25 < 1 / 2.5, so the head is asked and its tree merged as before
    for step_rows in (4.0, 20.0):
        drafter.step_cost = without.step_cost = StepCost.linear(step_rows)
        merged, want = (d.propose_tree(weak, 4, SamplingParams(), None) for d in (drafter, without))
        assert (merged.tokens.tolist(), merged.parents, merged.proposers) == (want.tokens.tolist(), want.parents,
                                                                           want.proposers)
    assert head.asked == 5 and "head" in merged.proposers


def test_a_datastore_chain_beside_a_tree_is_worth_a_share_of_its_table():
    store = Datastore.build([[7, 8, 9, 10, 11]])
    ids = [40, 41, 7, 8, 9]  # the store's tail 7 8 9 (3 tokens) continues 10 11
    tree = LookupGraftedDrafter(_UnlikelyHead(), "grafted", store, store_tokens=2).propose_tree(ids, 4, SamplingParams(), None)
    stored = [i for i, proposer in enumerate(tree.proposers) if proposer == "rest"]
    assert tree.tokens[stored].tolist() == [10, 11]
    assert [tree.values[i] for i in stored] == pytest.approx([STORE_BESIDE_A_TREE * v for v in STORE_ACCEPTANCE[3][:2]])


def test_a_store_chain_that_no_cut_could_keep_is_not_looked_up():
    """Beside a tree the store's chain is worth at most STORE_BESIDE_A_TREE times its table's best, and a cut
    at step_rows never keeps a node worth 1 / step_rows or less: below that the store is not asked, and the
    tree is the one its chain would have been cut from."""
    store = Datastore.build([[7, 8, 9, 10, 11]])
    ids = [40, 41, 7, 8, 9]
    best = STORE_BESIDE_A_TREE * max(row[0] for row in STORE_ACCEPTANCE.values())
    asked = []
    lookup = store.continuation_match
    store.continuation_match = lambda *a: asked.append(a) or lookup(*a)
    for step_rows, looked_up in ((0.9 / best, False), (3.0 / best, True)):
        drafter = LookupGraftedDrafter(_UnlikelyHead(), "grafted", store, store_tokens=2,
                                       step_cost=StepCost.linear(step_rows))
        tree = drafter.propose_tree(ids, 4, SamplingParams(), None)
        assert bool(asked) == looked_up
        drafter.store = None
        without = drafter.propose_tree(ids, 4, SamplingParams(), None)
        if not looked_up:
            assert (tree.tokens.tolist(), tree.parents, tree.values) == (without.tokens.tolist(), without.parents,
                                                                      without.values)
        else:
            assert "rest" in tree.proposers  # its first node, worth best > 1 / step_rows, is kept


def test_lookup_match_reports_the_matched_tail_length():
    assert lookup_match([1, 2, 3, 9, 1, 2, 3], 2) == ([9, 1], 3)
    assert lookup_match([5, 2, 9, 4, 2], 3) == ([9, 4, 2], 1)
    assert lookup_match([1, 2, 3], 2) == ([], 0)
    assert chain_acceptance({1: (0.5, 0.2), 3: (0.9, 0.8, 0.7)}, 3, 5) == [0.9, 0.8, 0.7, 0.7, 0.7]
    assert chain_acceptance({1: (0.5, 0.2), 3: (0.9, 0.8, 0.7)}, 4, 1) == [0.9]  # longer matches: the longest row
    assert chain_acceptance({1: (0.5,)}, 0, 2) == [0.0, 0.0]


def test_static_shape_from_paths():
    shape = TreeShape.from_paths(MEDUSA_PATHS)
    assert shape.parents == (-1, 0, 0, 1, 1, 2, 3)
    assert shape.ranks == (0, 0, 1, 0, 1, 0, 0)
    assert shape.depth == 3
    assert shape.truncated(1).parents == (-1, 0, 0)
    assert node_depths(shape.parents) == [0, 1, 1, 2, 2, 2, 3]
    assert ancestor_path(shape.parents, 6) == [1, 3, 6]
    mask = tree_attention(shape.parents)
    assert mask[6].tolist() == [True, True, False, True, False, False, True]
    assert mask.sum() == sum(d + 1 for d in node_depths(shape.parents))


def test_dynamic_selection_keeps_best_ancestor_closed_nodes():
    parents = [-1, 0, 0, 1, 1, 2, 3]
    values = [1.0, 0.6, 0.3, 0.5, 0.05, 0.29, 0.45]
    assert select_by_value(parents, values, budget=4) == [0, 1, 2, 3, 6]
    assert select_by_value(parents, values, budget=2) == [0, 1, 3]
    # a child that ties with its parent stays behind it
    assert select_by_value([-1, 0, 1], [1.0, 0.5, 0.5], budget=1) == [0, 1]


class _HashedDrafter(DraftModelTreeDrafter):
    """Dynamic-tree drafting over fixed random distributions: a node's draft logits depend only on its
    path, so a tree can be grown twice and compared. Counts the drafting rounds it served."""

    def __init__(self, top_k, budget, seed, vocab=12):
        super().__init__(None, None, top_k=top_k, budget=budget)
        self.seed, self.vocab, self.rounds = seed, vocab, 0

    def _draft_scores(self, ids, tokens, parents, nodes, params):
        self.rounds += 1
        rows = []
        for node in nodes:
            path = tuple(tokens[i] for i in ancestor_path(parents, node))
            gen = torch.Generator().manual_seed(hash((self.seed, path)) % 2**31)
            rows.append(torch.randn(self.vocab, generator=gen) * 3)  # peaked, so values fall fast
        return torch.stack(rows)

    def _tree(self, tokens, parents, rows, without_replacement, values=()):
        return DraftTree(torch.tensor(tokens), tuple(parents), None, without_replacement, (), values)


def _fully_grown_tree(drafter, ids, depth):
    """The dynamic tree as EAGLE-2 defines it: every level grown, then the budget best nodes kept."""
    tokens, parents, values, frontier = [ids[-1]], [-1], [1.0], [0]
    for _ in range(depth):
        grown = []
        for node, top in zip(frontier, drafter._top_candidates(ids, tokens, parents, frontier, SamplingParams())):
            for prob, token in top:
                grown.append(len(tokens))
                tokens.append(token)
                parents.append(node)
                values.append(values[node] * prob)
        frontier = sorted(grown, key=lambda i: (-values[i], i))[: drafter.top_k]
    kept = select_by_value(parents, values, drafter.budget)
    new_index = {old: new for new, old in enumerate(kept)}
    return [tokens[i] for i in kept], [new_index[parents[i]] if i else -1 for i in kept]


def test_dynamic_tree_stops_drafting_only_when_deeper_levels_cannot_be_kept():
    stopped_early = 0
    for seed in range(60):
        for top_k, budget in ((2, 4), (3, 6), (4, 8)):
            drafter = _HashedDrafter(top_k, budget, seed)
            tree = drafter.propose_tree([1, 2, 3], 6, SamplingParams(), None)
            stopped_early += drafter.rounds < 6
            want_tokens, want_parents = _fully_grown_tree(_HashedDrafter(top_k, budget, seed), [1, 2, 3], 6)
            assert tree.tokens.tolist() == want_tokens and list(tree.parents) == want_parents
    assert stopped_early > 20  # the shortcut is taken, so the equality above tests it


def test_dynamic_tree_with_a_cost_cut_skips_only_levels_the_cut_would_drop():
    """With a step cost, drafting stops below nodes at or under worth_floor, and the tree is exactly the
    uncut drafter's tree cut by keep_worthwhile."""
    shortened = 0
    for seed in range(60):
        for top_k, budget, step_rows in ((2, 4, 2.0), (3, 6, 4.0), (4, 8, 8.0)):
            drafter = _HashedDrafter(top_k, budget, seed)
            drafter.step_cost = StepCost.linear(step_rows)
            tree = drafter.propose_tree([1, 2, 3], 6, SamplingParams(), None)
            uncut = _HashedDrafter(top_k, budget, seed)
            want = keep_worthwhile(uncut.propose_tree([1, 2, 3], 6, SamplingParams(), None), drafter.step_cost)
            assert tree.tokens.tolist() == want.tokens.tolist() and tree.parents == want.parents
            shortened += drafter.rounds < uncut.rounds
    assert shortened > 20  # the floor saves drafting rounds, so the equality above tests it


# --- one target forward over a tree -------------------------------------------------------------


@pytest.fixture(scope="module")
def target_model():
    return tiny_llama(seed=0)


def _random_tree(gen, vocab, shape):
    tokens = torch.randint(vocab, (len(shape.parents),), generator=gen).tolist()
    return tokens, list(shape.parents)


def _plain_logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("warm", [False, True])
def test_tree_logits_equal_plain_model_on_each_path(target_model, attn, warm):
    original = target_model.config._attn_implementation
    target_model.config._attn_implementation = attn
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = target_model.config.vocab_size
        ids = tiny_tokenizer()(PROMPT)["input_ids"]
        lm = CachedModel(target_model)
        if warm:
            lm.prefill(ids[:5])  # part of the context is cached, the rest is fed with the tree
        shape = TreeShape.from_paths(MEDUSA_PATHS + [[2], [0, 0, 0, 0], [0, 0, 1]])
        tokens, parents = _random_tree(gen, vocab, shape)
        tokens[0] = ids[-1]
        logits = lm.forward_tree(ids, tokens, parents)  # [N, V]
        assert lm.cached_ids == ids + [TREE_SLOT] * (len(tokens) - 1)
        for node in range(len(tokens)):
            path_tokens = [tokens[i] for i in ancestor_path(parents, node)]
            expected = _plain_logits(target_model, ids + path_tokens)
            torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)
    finally:
        target_model.config._attn_implementation = original


def test_keeping_a_path_equals_fresh_prefill(target_model):
    gen = torch.Generator().manual_seed(1)
    vocab = target_model.config.vocab_size
    shape = TreeShape.from_paths(MEDUSA_PATHS + [[2], [0, 0, 0, 0], [1, 0, 0], [0, 2]])
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    lm = CachedModel(target_model)
    lm.prefill(ids)
    for round_ in range(40):
        tokens, parents = _random_tree(gen, vocab, shape)
        tokens[0] = ids[-1]
        lm.forward_tree(ids, tokens, parents)
        leaf = int(torch.randint(len(tokens), (), generator=gen))
        path = ancestor_path(parents, leaf)[: int(torch.randint(4, (), generator=gen))]
        lm.keep_tree_path(tokens, path)
        ids = ids + [tokens[i] for i in path] + [int(torch.randint(vocab, (), generator=gen))]
        assert lm.cached_ids == ids[:-1]
        if round_ % 10 == 9:
            assert_cache_matches_fresh_prefill(target_model, lm)
    # a plain forward after tree steps continues the same cache correctly
    torch.testing.assert_close(lm.forward(ids, [], 1)[0], _plain_logits(target_model, ids), atol=1e-4, rtol=1e-4)


def test_truncate_discards_an_unkept_tree(target_model):
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    lm = CachedModel(target_model)
    lm.prefill(ids)
    shape = TreeShape.from_paths(MEDUSA_PATHS)
    tokens = [ids[-1]] + [3] * (len(shape.parents) - 1)
    lm.forward_tree(ids, tokens, list(shape.parents))
    lm.truncate(lm.common_prefix(ids))  # what a drafter's commit does
    assert lm.cached_ids == ids
    torch.testing.assert_close(lm.forward(ids, [7], 1)[0], _plain_logits(target_model, ids + [7]), atol=1e-4, rtol=1e-4)


# --- tree decoding end to end -------------------------------------------------------------------


def _prompt_ids():
    return tiny_tokenizer()(PROMPT)["input_ids"]


def _run(target, drafter, config, eos_ids=()):
    events = list(generate(target, tiny_tokenizer(), _prompt_ids(), config, drafter, eos_ids))
    assert isinstance(events[-1], Summary)
    return events, events[-1]


@pytest.fixture(scope="module")
def draft_model():
    return tiny_llama(seed=1, layers=1)


def _tree_drafters(draft_model):
    return [
        DraftModelTreeDrafter(CachedModel(draft_model), TreeShape.from_paths(MEDUSA_PATHS)),
        DraftModelTreeDrafter(CachedModel(draft_model), None, top_k=3, budget=10),
        LookupGraftedDrafter(DraftModelTreeDrafter(CachedModel(draft_model), None, top_k=2, budget=4), "tree_lookup"),
    ]


def _long_lookup_drafter(draft_model):
    """Lookup chains of 8 tokens below a tree of the draft depth, as the shipped eagle_lookup grafts."""
    base = DraftModelTreeDrafter(CachedModel(draft_model), None, top_k=2, budget=4)
    return LookupGraftedDrafter(base, "tree_lookup", lookup_tokens=8, store_tokens=2)


class _RootOnly:
    """A tree drafter that proposes nothing, so the grafted chains are the whole tree."""

    name = "root"

    def prefill(self, ids):
        pass

    def commit(self, ids):
        pass

    def propose_tree(self, ids, depth, params, generator):
        return DraftTree(torch.tensor([ids[-1]]), (-1,), None)


def test_grafted_chains_have_their_own_lengths():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]  # lookup: the tail "1 2" was followed by 3 .. 10, 1, 2
    store = Datastore.build([[2, 20, 21, 22, 23]])  # after "2": 20 21 22 23
    greedy = SamplingParams(temperature=0.0)

    def chains(drafter):
        tree = drafter.propose_tree(ids, 3, greedy, None)
        depths = node_depths(list(tree.parents))
        return {p: max(d for d, q in zip(depths, tree.proposers) if q == p) for p in set(tree.proposers) - {""}}

    assert chains(LookupGraftedDrafter(_RootOnly(), "x", store)) == {"lookup": 3, "rest": 3}  # None: the depth
    assert chains(LookupGraftedDrafter(_RootOnly(), "x", store, lookup_tokens=8, store_tokens=2)) == {"lookup": 8, "rest": 2}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_tree_greedy_equality(target_model, draft_model, k):
    n = 40
    reference = hf_greedy(target_model, _prompt_ids(), n)
    for drafter in [*_tree_drafters(draft_model), _long_lookup_drafter(draft_model)]:
        _, summary = _run(CachedModel(target_model), drafter, GenerationConfig(k=k, max_new_tokens=n))
        assert list(summary.token_ids) == reference
        assert summary.drafted > 0


def test_tree_with_draft_equal_to_target_accepts_full_depth(target_model):
    for drafter in _tree_drafters(target_model):
        events, summary = _run(CachedModel(target_model), drafter, GenerationConfig(k=3, max_new_tokens=41))
        assert summary.accepted == summary.drafted > 0
        sources = {e.source for e in events if isinstance(e, TokenEvent)}
        assert sources <= {"draft_accepted", "bonus", "target"}  # "target": the last, undrafted step
        assert summary.mean_accepted_length == pytest.approx(41 / summary.steps)
        assert summary.mean_accepted_length > 3.0  # depth 3: up to 4 tokens per step


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_steps_keep_caches_committed_and_events_consistent(target_model, draft_model, temperature):
    for drafter in [*_tree_drafters(draft_model), _long_lookup_drafter(draft_model)]:
        target = CachedModel(target_model)
        config = GenerationConfig(k=3, max_new_tokens=37, sampling=SamplingParams(temperature=temperature), seed=5)
        events, summary = _run(target, drafter, config)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        steps = [e for e in events if isinstance(e, StepEvent)]
        assert summary.new_tokens == len(tokens) == 37
        assert sum(s.emitted for s in steps) == 37 and len(steps) == summary.steps
        committed = _prompt_ids() + list(summary.token_ids)
        # every committed token is cached but the last, which no forward has read yet
        assert target.cached_ids == committed[:-1]
        for t in tokens:
            assert 0.0 <= t.p_target <= 1.0
            if t.source == "draft_accepted":
                assert t.p_draft is not None and t.p_target > 0
            if t.source == "bonus":
                assert t.p_draft is None
        assert_cache_matches_fresh_prefill(target_model, target)
