import pytest

from speclens.engine.decoding.advisor import (
    Costs,
    advise_steps,
    expected_tokens,
    measure_costs,
    measured_acceptance,
    predict,
    prefix_acceptance,
)
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent


def test_iid_acceptance_matches_closed_form():
    # i.i.d. acceptance a: E = (1 - a^(K+1)) / (1 - a); K=5, a=0.8 -> 3.69 (Leviathan et al. 2023)
    a = 0.8
    per_position = [a ** (i + 1) for i in range(5)]
    assert expected_tokens(per_position, 5) == pytest.approx((1 - a**6) / (1 - a))
    assert expected_tokens(per_position, 5) == pytest.approx(3.68928)


def test_hand_computed_speedup():
    # accept P(first 1)=0.5, P(first 2)=0.25; draft 1 ms/token; verify 10 ms + 1 ms/token.
    costs = Costs.line(draft_s_per_token=0.001, verify_base_s=0.010, verify_per_token_s=0.001)
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
    assert costs.verify_s(1) == pytest.approx(0.012)
    assert costs.verify_s(9) - costs.verify_s(1) == pytest.approx(8 * 0.002)


def test_steps_without_drafts_shrink_the_prediction():
    costs = Costs.line(draft_s_per_token=0.0, verify_base_s=0.010, verify_per_token_s=0.0)
    always = predict([0.5, 0.25], costs, k_max=2)
    half = predict([0.5, 0.25], costs, k_max=2, drafting_share=0.5)
    assert always.expected_tokens[1] == pytest.approx(1.75)
    assert half.expected_tokens[1] == pytest.approx(1.375)
    assert half.speedup[1] == pytest.approx(1.375)


def _steps(pairs, verify_s=lambda drafted: 0.010):
    """StepEvents of (drafted, accepted) pairs, 1 ms of drafting a token."""
    out, new = [], 0
    for i, (drafted, accepted) in enumerate(pairs):
        new += accepted + 1
        out.append(StepEvent(i, drafted, drafted, accepted, accepted + 1, 0.001 * drafted, verify_s(drafted), new, 0.0))
    return out


def test_measured_acceptance_shrinks_few_steps_and_keeps_many():
    # 8 steps, all 6 drafts accepted: each conditional acceptance is (8 + 1) / (8 + 2), not 1
    assert measured_acceptance(_steps([(6, 6)] * 8)) == pytest.approx([0.9**i for i in range(1, 7)])
    # position 1 accepted in 3 of 4 steps, position 2 in 1 of the 3 that reached it; a lookup step that
    # drafted 1 token does not count at position 2
    steps = _steps([(2, 2), (2, 1), (1, 1), (2, 0)])
    assert measured_acceptance(steps) == pytest.approx([4 / 6, 4 / 6 * 2 / 4])
    # many steps: the counted frequency (800 of 1000 accepted a 1-token draft)
    many = measured_acceptance(_steps([(1, 1)] * 800 + [(1, 0)] * 200))
    assert many == pytest.approx([801 / 1002]) and abs(many[0] - 0.8) < 1e-3
    assert measured_acceptance(_steps([(0, 0)] * 3)) == []


def test_measure_costs_scales_the_engines_curve_to_the_answer():
    # every step verified 6 drafts (7 rows), so the answer alone cannot tell how cost grows with K
    steps = _steps([(6, 3)] * 5, verify_s=lambda drafted: 0.012)
    flat = measure_costs(steps)
    assert flat.verify_s(17) == pytest.approx(flat.verify_s(7)) == pytest.approx(0.012)
    shape = StepCost(tuple(1.0 + 0.25 * n for n in range(9)))  # a forward's rows, in any unit
    costs = measure_costs(steps, shape)
    scale = 0.012 / shape(6)
    assert costs.verify_s(7) == pytest.approx(0.012)
    assert costs.verify_s(1) == pytest.approx(scale * 1.0)
    assert costs.verify_s(17) == pytest.approx(scale * (1.0 + 0.25 * 16))  # extended past the timed 9
    assert costs.draft_s_per_token == pytest.approx(0.001)


def test_a_short_fully_accepted_answer_does_not_predict_an_unbounded_speedup():
    # prompt lookup on a "repeat this list" answer: 8 steps, every draft of 6 accepted, no drafting cost,
    # each forward of 7 tokens 12 ms; the engine timed forwards of 1..9 tokens at 6 ms + 1 ms a token
    steps = [StepEvent(i, 6, 6, 6, 7, 0.0, 0.012, 7 * (i + 1), 0.0) for i in range(8)]
    shape = StepCost(tuple(0.006 + 0.001 * n for n in range(9)))
    advice = advise_steps(steps, 16, shape)
    scale = 0.012 / shape(6)
    e16 = 1 + sum(0.9**i for i in range(1, 17))
    assert advice.expected_tokens[15] == pytest.approx(e16)
    assert advice.speedup[15] == pytest.approx(e16 / (scale * shape(16)) * (scale * shape(0)))  # 3.9x, not 17x
    assert advice.speedup[15] < 4.0
    best = advice.best_k
    assert advice.speedup[best - 1] == max(advice.speedup) and 4 < best < 16
