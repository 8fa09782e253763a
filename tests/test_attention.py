import pytest
import torch

from speclens.engine.runtime import attention
from speclens.engine.runtime.attention import ATTENTION_NAME, grouped_query_attention, use_grouped_attention
from speclens.engine.runtime.cache import CachedModel
from tests.tiny import tiny_llama


def _reference(query, key, value, mask):
    """What HF does for a masked block of queries: every key/value head repeated per query head."""
    groups = query.shape[1] // key.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1), attn_mask=mask
    )


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 2), (4, 4)])
@pytest.mark.parametrize("length", [1, 5])
def test_grouped_query_attention_equals_repeated_keys_and_values(heads, kv_heads, length):
    gen = torch.Generator().manual_seed(heads * 10 + length)
    query = torch.randn(1, heads, length, 16, generator=gen)
    key, value = torch.randn(2, 1, kv_heads, 40, 16, generator=gen)
    allowed = torch.rand(1, 1, length, 40, generator=gen) > 0.3
    allowed[..., 0] = True  # every row attends somewhere
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (allowed, additive):
        torch.testing.assert_close(grouped_query_attention(query, key, value, mask),
                                   _reference(query, key, value, mask))
    # a wrong grouping (head h on key/value head h % G instead of h // (H / G)) is caught
    if kv_heads < heads:
        wrong = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat(1, heads // kv_heads, 1, 1), value.repeat(1, heads // kv_heads, 1, 1), attn_mask=allowed
        )
        assert not torch.allclose(grouped_query_attention(query, key, value, allowed), wrong)


def test_grouped_attention_model_gives_the_same_logits_and_is_used(monkeypatch):
    model = tiny_llama(seed=3)  # 4 query heads over 2 key/value heads
    ids = list(range(5, 60))
    tree, parents = [ids[-1], 7, 8, 9, 10], [-1, 0, 0, 1, 2]

    def run():
        lm = CachedModel(model)
        lm.lean = None  # HF's forward, through its attention interface (the static-cache one calls it directly)
        lm.reset()
        lm.prefill(ids)
        return lm.forward(ids, [7, 8, 9], 4), lm.forward_tree(ids, tree, parents), lm.forward(ids + [11], [], 1)

    stock = run()
    assert use_grouped_attention(model) and model.config._attn_implementation == ATTENTION_NAME
    calls = []
    original = attention.grouped_query_attention
    monkeypatch.setattr(attention, "grouped_query_attention", lambda *a: calls.append(a[0].shape) or original(*a))
    grouped = run()
    assert calls  # the verification blocks went through it; the one-token step did not need it
    for want, got in zip(stock, grouped):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
