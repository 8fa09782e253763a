import pytest

from speclens.engine.decoding.advisor import Costs, expected_tokens, measure_costs, predict, prefix_acceptance
from speclens.engine.decoding.events import StepEvent


def test_iid_acceptance_matches_closed_form():
    # i.i.d. acceptance a: E = (1 - a^(K+1)) / (1 - a); K=5, a=0.8 -> 3.69 (Leviathan et al. 2023)
    a = 0.8
    per_position = [a ** (i + 1) for i in range(5)]
    assert expected_tokens(per_position, 5) == pytest.approx((1 - a**6) / (1 - a))
    assert expected_tokens(per_position, 5) == pytest.approx(3.68928)


def test_hand_computed_speedup():
    # accept P(first 1)=0.5, P(first 2)=0.25; draft 1 ms/token; verify 10 ms + 1 ms/token.
    costs = Costs(draft_s_per_token=0.001, verify_base_s=0.010, verify_per_token_s=0.001)
    advice = predict([0.5, 0.25], costs, k_max=3)
    # K=1: E=1.5, T=0.001+0.012=0.013, AR rate 1/0.011 -> 1.5/0.013*0.011 = 1.269230...
    assert advice.speedup[0] == pytest.approx(1.5 / 0.013 * 0.011)
    # K=2: E=1.75, T=0.002+0.013=0.015 -> 1.2833...
    assert advice.speedup[1] == pytest.approx(1.75 / 0.015 * 0.011)
    # K=3: tail ratio 0.5 -> P(first 3)=0.125, E=1.875, T=0.003+0.014=0.017 -> 1.2132...
    assert advice.speedup[2] == pytest.approx(1.875 / 0.017 * 0.011)
    assert advice.best_k == 2


def test_prefix_acceptance_extends_geometrically():
    assert prefix_acceptance([0.9, 0.81], 4) == pytest.approx([0.9, 0.81, 0.729, 0.6561])
    assert prefix_acceptance([], 2) == [0.0, 0.0]


def test_measure_costs_fits_a_line():
    steps = [StepEvent(i, n, n, 0, 1, 0.002 * n, 0.01 + 0.002 * (n + 1), 0, 0.0) for i, n in enumerate([1, 2, 4, 8])]
    costs = measure_costs(steps)
    assert costs.draft_s_per_token == pytest.approx(0.002)
    assert costs.verify_per_token_s == pytest.approx(0.002)
    assert costs.verify_base_s == pytest.approx(0.01)


def test_steps_without_drafts_shrink_the_prediction():
    costs = Costs(draft_s_per_token=0.0, verify_base_s=0.010, verify_per_token_s=0.0)
    always = predict([0.5, 0.25], costs, k_max=2)
    half = predict([0.5, 0.25], costs, k_max=2, drafting_share=0.5)
    assert always.expected_tokens[1] == pytest.approx(1.75)
    assert half.expected_tokens[1] == pytest.approx(1.375)
    assert half.speedup[1] == pytest.approx(1.375)
