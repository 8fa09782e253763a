"""The lean Llama forward (engine/lean_forward.py, the native extension's `decoder`): HF's forward on the
same native kernels up to float32 rounding, for prefill, blocks, trees, hidden states and the KV cache;
batch invariant; used only where it applies; and the EAGLE head's native attention path. (Bit-for-bit
invariance through CachedModel: tests/test_native_kernels.py; greedy equality of every method on a
native target, which runs through the lean forward: tests/test_cpu_kernels.py.)"""

import copy

import pytest
import torch

from speclens.engine.runtime.cache import AppendLayer, CachedModel
from speclens.engine.runtime.lean_forward import lean_forward_for
from speclens.engine.runtime.models import _use_cpu_kernels
from speclens.engine.runtime.native_kernels import native_build, use_native_linears
from tests.native import native_or_skip, needs_native
from tests.tiny import tiny_llama, tiny_tokenizer

native = native_build().module

PROMPT = "one two three four five six one two three four"


def _native_tiny(seed=0):
    model = tiny_llama(seed=seed, layers=3)
    _use_cpu_kernels(model, "native", torch.float32, lambda *a: None)
    return model


def _pair(model):
    """The same model through the lean forward and through HF's, both keeping hidden states."""
    lean, hf = CachedModel(model), CachedModel(model)
    assert lean.lean is not None
    hf.lean = None
    lean.keep_hidden = hf.keep_hidden = True
    return lean, hf


def _close(got, want):
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_native
def test_lean_forward_computes_hfs_forward():
    model = _native_tiny()
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    lean, hf = _pair(model)
    tree = [ids[-1], ids[0], ids[1], ids[2], ids[3]]
    calls = [
        lambda m: m.forward(ids, [], 2),  # prefill, the last two rows' logits
        lambda m: m.forward(ids, ids[:4], 5),  # a verification block
        lambda m: m.forward(ids + ids[:2], [], 1),  # a rollback, then one token
        lambda m: m.forward_tree(ids, tree, [-1, 0, 0, 1, 3]),  # a tree
    ]
    for call in calls:
        want = call(hf)
        got = call(lean)
        _close(got, want)
        _close(lean.hidden, hf.hidden)
        assert (lean.hidden_start, lean.hidden_end) == (hf.hidden_start, hf.hidden_end)
        assert lean.cached_ids == hf.cached_ids
        for a, b in zip(lean._cache.layers, hf._cache.layers):
            _close(a.keys, b.keys)
            _close(a.values, b.values)
    lean.keep_tree_path(tree, [2, 3])
    hf.keep_tree_path(tree, [2, 3])
    _close(lean.forward(lean.cached_ids + [ids[5]], [], 1), hf.forward(hf.cached_ids + [ids[5]], [], 1))


@needs_native
def test_keeping_a_tree_path_moves_the_rows_in_every_buffer_exactly():
    """The lean cache keeps a tree's accepted path with one native call (move_rows); it leaves every
    layer's keys and values bit for bit as the indexing path does."""
    model = _native_tiny(seed=3)
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    tree, parents = [ids[-1], ids[0], ids[1], ids[2], ids[3], ids[4]], [-1, 0, 0, 2, 2, 4]
    native_path, torch_path = CachedModel(model), CachedModel(model)
    for lm in (native_path, torch_path):
        lm.prefill(ids)
        lm.forward_tree(ids, tree, parents)
    torch_path.lean = None  # keep_tree_path's indexing fallback on the same buffers
    native_path.keep_tree_path(tree, [2, 4, 5])
    torch_path.keep_tree_path(tree, [2, 4, 5])
    assert native_path.cached_ids == torch_path.cached_ids == ids[:-1] + [ids[-1], ids[1], ids[3], ids[4]]
    for a, b in zip(native_path._cache.layers, torch_path._cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    before = native_path._cache.layers[0].keys.clone()
    with pytest.raises(RuntimeError, match="ascend"):  # a row moved away from the start is refused
        native.move_rows([layer.buffers[0] for layer in native_path._cache.layers], [3], [4])
    assert torch.equal(native_path._cache.layers[0].keys, before)


@needs_native
def test_lean_forward_is_batch_invariant_and_grows_its_cache():
    """A long prompt (past the cache's first 256 slots, so its buffers grow mid-way), then a block: every
    row bit for bit what one-token decoding gives."""
    model = _native_tiny(seed=2)
    ids = (tiny_tokenizer()(PROMPT)["input_ids"] * 30)[:300]
    block, decoded = CachedModel(model), CachedModel(model)
    block.prefill(ids[:250])
    together = block.forward(ids[:250], ids[250:262], 13)  # [13, V]
    decoded.prefill(ids[:250])
    alone = torch.stack([decoded.forward(ids[: 250 + i], [], 1)[0] for i in range(13)])
    assert torch.equal(together, alone)
    assert block._cache.layers[0].buffers[0].shape[-2] > 256


@needs_native
def test_lean_forward_without_hidden_states_gives_the_same_logits():
    model = _native_tiny(seed=1)
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    plain, keeping = CachedModel(model), CachedModel(model)
    keeping.keep_hidden = True
    assert torch.equal(plain.forward(ids, [], 3), keeping.forward(ids, [], 3))
    assert plain.hidden is None


def test_lean_forward_only_where_it_applies():
    stock = tiny_llama()
    assert lean_forward_for(stock) is None  # PyTorch's kernels: the static-cache forward in PyTorch
    assert CachedModel(stock).runtime == "static-cache forward"
    native_or_skip()
    bfloat16_panels = tiny_llama()
    use_native_linears(bfloat16_panels, native, bfloat16=True)
    assert lean_forward_for(bfloat16_panels) is None  # native linears, but not the target's float32 ones
    biased = tiny_llama()
    for layer in biased.model.layers:
        layer.self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(layer.self_attn.q_proj.out_features))
    _use_cpu_kernels(biased, "native", torch.float32, lambda *a: None)
    assert lean_forward_for(biased) is None  # a bias: the static-cache forward, on the native linears
    assert CachedModel(biased).runtime == "static-cache forward"
    gelu = _native_tiny()
    gelu.config.hidden_act = "gelu"
    assert lean_forward_for(gelu) is None
    model = _native_tiny()
    assert lean_forward_for(model) is not None and lean_forward_for(model) is lean_forward_for(model)


@needs_native
def test_eagle_head_on_the_native_kernels_computes_what_it_computes_on_pytorchs():
    from speclens.engine.drafters.eagle import EagleHead

    target = tiny_llama()
    head = EagleHead.for_target(target.config).eval()
    fast = copy.deepcopy(head)
    h = target.config.hidden_size
    generator = torch.Generator().manual_seed(2)
    x, f = torch.randn(2, 7, h, generator=generator)
    positions = torch.tensor([0, 1, 2, 3, 4, 4, 5])  # nodes 4 and 5 are siblings, 6 is 5's child
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    mask[5, 4] = mask[6, 4] = False
    with torch.inference_mode():
        fast(x, f, positions, mask)  # on PyTorch's kernels first: the head notes it cannot use the native call
        assert fast._native_weights() is None
        use_native_linears(fast, native)  # float32 panels: only the kernels differ
        assert fast._native_weights() is not None  # the swapped linears are seen
        torch.testing.assert_close(fast(x, f, positions, mask), head(x, f, positions, mask), atol=1e-5, rtol=1e-5)
        cache, want_cache = AppendLayer(), AppendLayer()
        fast(x[:4], f[:4], positions[:4], mask[:4, :4], cache)
        head(x[:4], f[:4], positions[:4], mask[:4, :4], want_cache)
        torch.testing.assert_close(fast(x[4:], f[4:], positions[4:], mask[4:], cache),
                                   head(x[4:], f[4:], positions[4:], mask[4:], want_cache), atol=1e-5, rtol=1e-5)
