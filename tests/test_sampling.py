import pytest
import torch

from speclens.engine.decoding.sampling import SamplingParams, process_logits, seen_mask

LOGITS = torch.tensor([[4.0, 3.0, 2.0, 1.0, -1.0]])
EMPTY = torch.empty(0, dtype=torch.long)


def probs(params, logits=LOGITS, history=EMPTY, block=EMPTY):
    return process_logits(logits, params, history, block).softmax(-1)


def test_temperature_and_top_k():
    p = probs(SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all()
    torch.testing.assert_close(p[0, :2], torch.tensor([4.0, 3.0]).softmax(-1))


def test_top_p_keeps_smallest_set_reaching_p():
    full = LOGITS.softmax(-1)[0]
    p = probs(SamplingParams(temperature=1.0, top_p=float(full[0] + 0.01)))
    assert (p[0, :2] > 0).all() and (p[0, 2:] == 0).all()
    p = probs(SamplingParams(temperature=1.0, top_p=float(full[0] - 0.01)))
    assert p[0, 0] == 1.0


def test_repetition_penalty_counts_block_tokens_per_row():
    logits = LOGITS.repeat(3, 1)  # rows after history, history+[0], history+[0, 3]
    out = process_logits(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0),
                         torch.tensor([1]), torch.tensor([0, 3]))
    assert out[0].tolist() == [4.0, 1.5, 2.0, 1.0, -1.0]
    assert out[1].tolist() == [2.0, 1.5, 2.0, 1.0, -1.0]
    assert out[2].tolist() == [2.0, 1.5, 2.0, 0.5, -1.0]


def test_seen_mask_rows():
    mask = seen_mask(torch.tensor([4]), torch.tensor([1, 2]), 5)
    assert mask.tolist() == [
        [False, False, False, False, True],
        [False, True, False, False, True],
        [False, True, True, False, True],
    ]


def test_greedy_returns_unwarped_logits():
    out = process_logits(LOGITS, SamplingParams(), EMPTY, EMPTY)
    torch.testing.assert_close(out, LOGITS)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_k=-2), dict(repetition_penalty=0),
                                 dict(temperature=float("nan")), dict(temperature=float("inf")), dict(temperature=101),
                                 dict(top_p=float("nan")), dict(repetition_penalty=float("nan")),
                                 dict(repetition_penalty=float("inf"))])
def test_invalid_params_are_refused(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):  # one line naming the setting and its range
        SamplingParams(**bad)
