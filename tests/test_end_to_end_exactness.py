"""End-to-end exactness of generate(): the joint law of the emitted tokens equals the target's.

A vocabulary of 8 makes the target's exact law of the first 4 tokens enumerable (8^4 sequences).
The same check is shown to fail when verification is swapped for a broken sampler.
"""

import dataclasses
import itertools

import pytest
import torch

import speclens.engine.decoding.decode as decode
import speclens.engine.decoding.step as step_module
import speclens.engine.decoding.tree as tree_module
import speclens.engine.decoding.verify as verify_module
from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import Summary
from speclens.engine.decoding.sampling import SamplingParams, process_logits
from speclens.engine.decoding.tree import CHAIN_PATHS, TreeShape
from speclens.engine.drafters.datastore import Datastore
from speclens.engine.drafters.draft_model import DraftModelDrafter
from speclens.engine.drafters.eagle import EagleDrafter, EagleHead
from speclens.engine.drafters.medusa import MedusaDrafter, MedusaHeads
from speclens.engine.drafters.trees import DraftModelTreeDrafter, LookupGraftedDrafter
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.tools.selftest import chi_square_p_value
from tests.broken_samplers import resample_from_target
from tests.tiny import tiny_llama

VOCAB, N_TOKENS, PROMPT = 8, 4, [1, 2, 3]
PARAMS = SamplingParams(temperature=1.0)


class SilentTokenizer:
    def decode(self, ids, **kwargs):
        return ""


@pytest.fixture(scope="module")
def models():
    return tiny_llama(seed=3, vocab=VOCAB), tiny_llama(seed=4, layers=1, vocab=VOCAB)


def exact_marginals(model, params: SamplingParams = PARAMS) -> torch.Tensor:
    """[N_TOKENS, V] exact law of each emitted position under plain sampling from the target with `params`
    (penalties and warpers applied to each step's logits given the tokens before it)."""
    seqs = torch.tensor(list(itertools.product(range(VOCAB), repeat=N_TOKENS)))  # [V^N, N]
    inputs = torch.cat([torch.tensor(PROMPT).expand(len(seqs), -1), seqs[:, :-1]], dim=1)
    with torch.inference_mode():
        logits = model(inputs).logits[:, len(PROMPT) - 1 :]  # [V^N, N, V]
    if params != PARAMS:
        empty = torch.zeros(0, dtype=torch.long)
        logits = torch.stack([torch.cat([process_logits(logits[i, j : j + 1], params, inputs[i, : len(PROMPT) + j], empty)
                                         for j in range(N_TOKENS)]) for i in range(len(seqs))])
    step_probs = logits.double().softmax(-1).gather(-1, seqs[..., None])[..., 0]  # [V^N, N]
    joint = step_probs.prod(-1)  # [V^N]
    return torch.stack([torch.zeros(VOCAB, dtype=torch.float64).index_add_(0, seqs[:, j], joint)
                        for j in range(N_TOKENS)])


def sampled_counts(models, config, trials, drafter=None) -> torch.Tensor:
    target, draft = models
    target_lm, drafter = CachedModel(target), drafter or DraftModelDrafter(CachedModel(draft))
    counts = torch.zeros(N_TOKENS, VOCAB, dtype=torch.float64)
    for seed in range(trials):
        config = GenerationConfig(**{**config.__dict__, "seed": seed})
        summary = list(generate(target_lm, SilentTokenizer(), PROMPT, config, drafter))[-1]
        assert isinstance(summary, Summary)
        for j, token in enumerate(summary.token_ids):
            counts[j, token] += 1
    return counts


def law_matches(counts, marginals) -> bool:
    expected = counts.sum(-1, keepdim=True) * marginals
    sigma = (expected * (1 - marginals)).sqrt()
    within = bool(((counts - expected).abs() <= 6 * sigma + 5).all())
    return within and min(chi_square_p_value(c, e) for c, e in zip(counts, expected)) > 1e-4


CONFIG = GenerationConfig(method="draft", k=3, adaptive_k=True, max_new_tokens=N_TOKENS, sampling=PARAMS)


def test_adaptive_k_generation_is_exact(models):
    counts = sampled_counts(models, CONFIG, trials=3000)
    assert law_matches(counts, exact_marginals(models[0]))


@pytest.mark.parametrize("with_store, step_rows, lookup_rows", [(False, None, None), (True, None, None),
                                                               (True, 3.0, None), (True, 3.0, 2.5)])
def test_lookup_grafted_tree_generation_is_exact(models, with_store, step_rows, lookup_rows):
    """Prompt lookup's chain (and a datastore's) grafted into a dynamic draft tree (what eagle_lookup
    does), verified at temperature > 0: the small vocabulary makes lookup find matches in most
    steps, so grafted branches are verified often. A step cost of step_rows rows cuts the head's tree and
    the merged tree to the nodes worth verifying, and one of lookup_rows verifies a likely lookup chain
    alone, as eagle_lookup does on a CPU."""
    step_cost = None if step_rows is None else StepCost.linear(step_rows)
    lookup_cost = None if lookup_rows is None else StepCost.linear(lookup_rows)
    store = Datastore.build(torch.randint(VOCAB, (20, 12), generator=torch.Generator().manual_seed(5)).tolist())
    base = DraftModelTreeDrafter(CachedModel(models[1]), None, top_k=2, budget=4, step_cost=step_cost)
    # with the store, chains of their own lengths (as shipped): lookup past the draft depth, the store's shorter
    drafter = (LookupGraftedDrafter(base, "tree_lookup", store, lookup_tokens=6, store_tokens=2, step_cost=step_cost,
                                    lookup_cost=lookup_cost)
               if with_store else LookupGraftedDrafter(base, "tree_lookup"))
    config = GenerationConfig(method="tree_lookup", k=3, max_new_tokens=N_TOKENS, sampling=PARAMS)
    counts = sampled_counts(models, config, trials=3000, drafter=drafter)
    assert law_matches(counts, exact_marginals(models[0]))


def test_lookup_grafted_check_fails_when_rejected_siblings_keep_their_mass(models, monkeypatch):
    monkeypatch.setattr(verify_module, "_residual", lambda p_target, p_draft: p_target)  # p not updated
    drafter = LookupGraftedDrafter(DraftModelTreeDrafter(CachedModel(models[1]), None, top_k=2, budget=4), "tree_lookup")
    config = GenerationConfig(method="tree_lookup", k=3, max_new_tokens=N_TOKENS, sampling=PARAMS)
    counts = sampled_counts(models, config, trials=3000, drafter=drafter)
    assert not law_matches(counts, exact_marginals(models[0]))


def test_check_fails_with_a_broken_verifier(models, monkeypatch):
    monkeypatch.setattr(step_module, "verify_chain", resample_from_target)
    counts = sampled_counts(models, CONFIG, trials=3000)
    assert not law_matches(counts, exact_marginals(models[0]))


# top-k, top-p and a repetition penalty together: what a user's settings can combine
WARPED = SamplingParams(temperature=2.5, top_k=5, top_p=0.9, repetition_penalty=1.5)


def _random_eagle(target, lm, shape, draft_vocab=None):
    torch.manual_seed(4)
    head = EagleHead.for_target(target.config)
    with torch.no_grad():
        for weight in head.parameters():
            if weight.dim() > 1:
                weight.normal_(0, 0.3)  # confident, often wrong drafts: many rejections to get right
    head.draft_vocab = draft_vocab
    return EagleDrafter(head, lm, shape, top_k=3, budget=6)


def _random_medusa(target, lm):
    torch.manual_seed(3)
    heads = MedusaHeads(target.config.hidden_size, VOCAB, num_heads=3)
    with torch.no_grad():
        for weight in heads.parameters():
            weight.normal_(0, 0.5)
    return MedusaDrafter(heads, lm, TreeShape.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]))


WARPED_DRAFTERS = {
    "draft_chain": lambda target, draft, lm: DraftModelDrafter(CachedModel(draft)),
    "sampled_tree": lambda target, draft, lm: DraftModelTreeDrafter(
        CachedModel(draft), TreeShape.from_paths([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])),
    "eagle_chain": lambda target, draft, lm: _random_eagle(target, lm, TreeShape.from_paths(CHAIN_PATHS)),
    "eagle_dynamic": lambda target, draft, lm: _random_eagle(target, lm, None),
    # drafts from 5 of the 8 tokens: q is 0 elsewhere, and exactness must not depend on it
    "eagle_dynamic_draft_vocab": lambda target, draft, lm: _random_eagle(target, lm, None, torch.tensor([0, 2, 3, 5, 6])),
    "medusa": lambda target, draft, lm: _random_medusa(target, lm),
}


def _warped_counts(models, name, trials=3000):
    target, draft = models
    lm = CachedModel(target)
    drafter = WARPED_DRAFTERS[name](target, draft, lm)
    config = GenerationConfig(method=name, k=3, max_new_tokens=N_TOKENS, sampling=WARPED)
    counts = torch.zeros(N_TOKENS, VOCAB, dtype=torch.float64)
    for seed in range(trials):
        summary = list(generate(lm, SilentTokenizer(), PROMPT, dataclasses.replace(config, seed=seed), drafter))[-1]
        for j, token in enumerate(summary.token_ids):
            counts[j, token] += 1
    return counts


@pytest.fixture(scope="module")
def warped_law(models):
    return exact_marginals(models[0], WARPED)


@pytest.mark.parametrize("name", sorted(WARPED_DRAFTERS))
def test_every_drafter_is_exact_under_top_k_top_p_and_repetition_penalty(models, warped_law, name):
    """Chains, sampled trees (siblings without replacement), EAGLE and Medusa heads at temperature 2.5
    with every processor on: the drafts come from warped draft distributions, and verification must
    still give the target's warped law."""
    assert law_matches(_warped_counts(models, name), warped_law)


def test_warped_check_fails_when_verification_forgets_the_warpers(models, warped_law, monkeypatch):
    """A tree step that scores the target without top-p and the repetition penalty (the drafter still
    warps): the law drifts and the same check rejects it."""
    original = tree_module.tree_scores
    monkeypatch.setattr(tree_module, "tree_scores", lambda logits, params, *rest: original(
        logits, dataclasses.replace(params, top_p=1.0, repetition_penalty=1.0), *rest))
    assert not law_matches(_warped_counts(models, "eagle_dynamic"), warped_law)


def test_adaptive_k_never_changes_greedy_output(models):
    target, draft = models
    outputs = []
    for adaptive in (False, True):
        config = GenerationConfig(k=4, adaptive_k=adaptive, max_new_tokens=40)
        summary = list(generate(CachedModel(target), SilentTokenizer(), PROMPT, config,
                                DraftModelDrafter(CachedModel(draft))))[-1]
        outputs.append(summary.token_ids)
    assert outputs[0] == outputs[1]


def test_draft_length_schedule():
    assert decode.next_draft_length(4, 4, 4, k_max=8) == 6
    assert decode.next_draft_length(7, 7, 7, k_max=8) == 8
    assert decode.next_draft_length(4, 4, 1, k_max=8) == 3
    assert decode.next_draft_length(1, 1, 0, k_max=8) == 1
