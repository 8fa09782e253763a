"""Training-time test for EAGLE heads: unrolled training passes compute what chain drafting computes."""

import pytest
import torch

from speclens.engine.drafters.eagle import EagleHead
from speclens.engine.tools.train.eagle import eagle_loss, unrolled_mask, unrolled_predictions
from speclens.engine.tools.train.loop import packed
from tests.tiny import tiny_llama


def _head_and_step(seed=0, lengths=(7, 6)):
    torch.manual_seed(seed)
    model = tiny_llama(seed=seed)
    head = EagleHead.for_target(model.config)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    hidden = model.config.hidden_size
    step = [{"tokens": torch.randint(0, model.config.vocab_size, (n,)), "features": torch.randn(n, hidden),
             "answer_start": torch.tensor(2)} for n in lengths]
    return model, head.eval(), step


def _draft_chain(head, embeds, inputs, c, depth):
    """What drafting computes: head inputs (f_0..f_c, x_1..x_{c+1}) of one sample, then depth-1
    drafted positions, each reading the previous prediction; returns the last predicted feature."""
    e, f = embeds[: c + 1], inputs[: c + 1]
    for j in range(depth):
        n = e.shape[0]
        out = head(e, f, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        if j == depth - 1:
            return out[-1]
        e, f = torch.cat([e, embeds[n : n + 1]]), torch.cat([f, out[-1:]])


@pytest.mark.parametrize("depth", [2, 3])
def test_unrolled_passes_equal_drafting_a_chain(depth):
    model, head, step = _head_and_step()
    positions, mask, _ = packed(step)
    tokens = torch.cat([s["tokens"][1:] for s in step])
    inputs = torch.cat([s["features"][:-1] for s in step])
    with torch.no_grad():
        embeds = model.get_input_embeddings()(tokens)
        predicted, valid = unrolled_predictions(head, embeds, inputs, positions, mask, depth)
    n = inputs.shape[0]
    assert predicted.shape == (depth * n, inputs.shape[1]) and valid[:n].all()
    starts = [0, int(step[0]["tokens"].shape[0]) - 1]  # each sample's first packed entry
    checked = 0
    for start, sample in zip(starts, step):
        length = int(sample["tokens"].shape[0]) - 1
        e, f = embeds[start : start + length], inputs[start : start + length]
        for t in range(length):
            for d in range(1, depth + 1):
                entry = (d - 1) * n + start + t
                assert bool(valid[entry]) == (t >= d - 1)
                if t < d - 1:
                    continue
                with torch.no_grad():
                    want = _draft_chain(head, e, f, t - d + 1, d)
                torch.testing.assert_close(predicted[entry], want, atol=1e-3, rtol=1e-3)
                checked += 1
    assert checked == sum(int(s["tokens"].shape[0]) - 1 - (d - 1) for s in step for d in range(1, depth + 1))


def test_unrolled_mask_blocks():
    mask = torch.ones(4, 4, dtype=torch.bool).tril()
    full, valid = unrolled_mask(mask, torch.arange(4), 2)
    assert valid.tolist() == [True] * 4 + [False, True, True, True]
    # pass 2, entry 2 (committed position 1, drafted one level below): pass-1 keys 0..1 and itself
    assert full[4 + 2].nonzero().flatten().tolist() == [0, 1, 4 + 2]
    assert full[4 + 0].nonzero().flatten().tolist() == [4 + 0]  # invalid: only itself
    assert not full[:4, 4:].any()  # teacher-forced pass never sees drafted entries


def test_unrolled_loss_trains_every_pass():
    model, head, step = _head_and_step(seed=1)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    head.train()
    grads, losses, agreements = [], [], []
    for unroll in (1, 2):
        head.zero_grad()
        loss, agreement = eagle_loss(head, step, embed, lm_head, 0.0, None, ce_weight=1.0, unroll=unroll)
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in head.parameters() if p.grad is not None]))
        losses.append(loss.detach())
        agreements.append(agreement)
    assert torch.isfinite(losses[1]) and not torch.isclose(losses[0], losses[1])
    assert agreements[0] == agreements[1]  # the reported agreement is pass 1's, teacher-forced
    # pass 2 adds its own gradient: the head is trained on the features it predicted itself
    assert grads[1].shape == grads[0].shape and not torch.allclose(grads[0], grads[1], rtol=1e-3, atol=1e-6)


def test_unroll_option_is_checked_before_any_work(tmp_path):
    from speclens.engine.tools.train.options import TrainOptions
    from speclens.engine.tools.train.run import run

    for kind, unroll in (("eagle", 0), ("medusa", 2)):
        with pytest.raises(ValueError, match="--unroll"):
            run(TrainOptions(kind, "default", ("missing.jsonl",), str(tmp_path / kind), unroll=unroll))
