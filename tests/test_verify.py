import pytest
import torch

from speclens.engine.decoding.verify import verify_chain, verify_chain_greedy
from speclens.engine.tools.selftest import check_chain_exactness
from tests.broken_samplers import BROKEN


@pytest.mark.parametrize("k", [1, 3])
def test_verify_chain_is_exact(k):
    result = check_chain_exactness(verify_chain, k=k, trials=65_536, seed=k)
    assert result.passed, result.describe()


@pytest.mark.parametrize("broken", BROKEN, ids=lambda f: f.__name__)
def test_exactness_check_rejects_broken_sampler(broken):
    result = check_chain_exactness(broken, k=3, trials=65_536, seed=3, name=broken.__name__)
    assert not result.passed, result.describe()


def test_one_hot_drafts_accept_with_target_probability():
    # Deterministic draft: accept with p(x); the residual is p without x.
    p_target = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.5, 0.0]], dtype=torch.float64)
    p_draft = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    outcomes = [verify_chain(p_target, p_draft, torch.tensor([2]), gen) for _ in range(2000)]
    assert all(n == 0 for n, _ in outcomes)  # p(x) = 0: never accepted
    share_1 = sum(t == 1 for _, t in outcomes) / len(outcomes)
    assert abs(share_1 - 0.75) < 0.05

    p_draft = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    outcomes = [verify_chain(p_target, p_draft, torch.tensor([1]), gen) for _ in range(4000)]
    accepted = sum(n == 1 for n, _ in outcomes) / len(outcomes)
    assert abs(accepted - 0.75) < 0.04
    assert all(t == 0 for n, t in outcomes if n == 0)  # residual is p with token 1 removed


def test_all_zero_residual_falls_back_to_target_row():
    # p == q exactly: acceptance is certain, but the function must not crash on a zero residual.
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]], dtype=torch.float64)
    n, token = verify_chain(p, p[:1].clone(), torch.tensor([1]), torch.Generator().manual_seed(0))
    assert (n, token) == (1, 0)


def test_draft_token_with_zero_draft_probability_does_not_crash():
    p_target = torch.tensor([[0.3, 0.7], [1.0, 0.0]], dtype=torch.float64)
    p_draft = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    n, token = verify_chain(p_target, p_draft, torch.tensor([1]), torch.Generator().manual_seed(0))
    assert n == 1 and token == 0


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        verify_chain(torch.ones(3, 4) / 4, torch.ones(1, 4) / 4, torch.tensor([0]))


def test_greedy_verification():
    assert verify_chain_greedy(torch.tensor([5, 6, 7, 8]), torch.tensor([5, 6, 7])) == (3, 8)
    assert verify_chain_greedy(torch.tensor([5, 9, 7, 8]), torch.tensor([5, 6, 7])) == (1, 9)
    assert verify_chain_greedy(torch.tensor([1]), torch.tensor([], dtype=torch.long)) == (0, 1)


def test_selftest_reports_failure_for_broken_verifiers():
    from speclens.engine.tools.selftest import run_selftest
    from tests.broken_samplers import resample_from_target

    good = run_selftest(None, trials=8192)
    assert good.passed, good.lines
    assert len(good.lines) == 3 and all(line.startswith("PASS") for line in good.lines)
    bad = run_selftest(None, trials=8192, verify=resample_from_target)
    assert not bad.passed
    assert any(line.startswith("FAIL chain") for line in bad.lines)
