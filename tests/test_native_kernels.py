"""SpecLens's native float32 kernels: a linear layer with the numbers nn.Linear gives and one fixed FMA
order per output, attention with the numbers softmax attention gives and one fixed order per query (so
rows are bit for bit the same alone or in a block, and so is a whole model's forward), the fallbacks
when they cannot be built, and the logits of a verified block and tree equal to one-token decoding's. (Greedy equality of every
head method on a native target: tests/test_cpu_kernels.py.)"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from speclens.engine.drafters.eagle import EagleHead
from speclens.engine.runtime import native_kernels
from speclens.engine.runtime.attention import (
    NATIVE_ATTENTION_NAME,
    _attention,
    _native_attention,
    grouped_query_attention,
)
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.cpu_kernels import drafter_linear, drafter_module, is_packed, native_kernel_of
from speclens.engine.runtime.masks import tree_attention
from speclens.engine.runtime.models import LoadOptions, ModelLoadError, _use_cpu_kernels
from speclens.engine.runtime.native_kernels import (
    NativeLinear,
    native_build,
    quantize_q8,
    quantize_q16,
    use_native_linears,
)
from speclens.engine.session import Engine
from speclens.engine.tools.selftest import block_invariance_line
from tests.native import native_or_skip, needs_integer, needs_native
from tests.tiny import loaded, q4_weight, q8_weight, tiny_llama, tiny_quantised_llama, tiny_tokenizer

native = native_build().module

PROMPT = "one two three four five six one two three four"


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_native_linear_computes_what_linear_computes(bias):
    torch.manual_seed(0)
    for out_features in (130, 64, 16, 200):  # tails inside a panel and inside a group of 64, and none
        linear = torch.nn.Linear(96, out_features, bias=bias)
        layer = NativeLinear(native, linear.weight, linear.bias)
        for shape in ((1, 96), (96,), (1, 7, 96), (2, 5, 96), (40, 96), (1, 0, 96)):
            x = torch.randn(shape)
            with torch.inference_mode():
                want, got = linear(x), layer(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_native
def test_bfloat16_panels_compute_with_the_rounded_weights_exactly_widened():
    """Drafters' weights as bfloat16 panels: the product is that of the bfloat16-rounded weight in
    float32 (the widening is exact), and blocks still equal their rows computed alone."""
    torch.manual_seed(7)
    linear = torch.nn.Linear(96, 130)
    layer = NativeLinear(native, linear.weight, linear.bias, bfloat16=True)
    assert layer.panels.dtype == torch.bfloat16 and "bfloat16 weights" in repr(layer)
    rounded = NativeLinear(native, linear.weight.detach().bfloat16().float(), linear.bias)  # float32 panels
    x = torch.randn(13, 96)
    with torch.inference_mode():
        assert torch.equal(layer(x), rounded(x))
        assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(13)]))
        torch.testing.assert_close(layer(x), linear(x), atol=5e-2, rtol=2e-2)


def _sequential_fma(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """x [M, K] @ weight [N, K]^T in float32 as one fused multiply-add chain per output, k = 0, 1, ...:
    the product of two float32 numbers is exact in float64, and each step rounds once to float32."""
    acc = np.zeros((x.shape[0], weight.shape[0]), dtype=np.float32)
    for k in range(x.shape[1]):
        exact = acc.astype(np.float64) + np.outer(x[:, k].astype(np.float64), weight[:, k].astype(np.float64))
        acc = exact.astype(np.float32)
    return acc


@needs_native
def test_each_output_is_one_fma_chain_in_input_order():
    """The kernel's result is exactly the sequential chain above, bit for bit, for every row count and
    tile shape; that is what makes a row's result independent of the block it is computed in."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(70, 24, generator=generator)  # [N, K]
    panels = native.pack(weight)
    for rows in (1, 2, 3, 7, 13, 25):
        x = torch.randn(rows, 24, generator=generator)
        got = native.linear(x, panels, None, 70).numpy()
        want = _sequential_fma(x.numpy(), weight.numpy())
        assert np.array_equal(got, want), rows
    # the comparison has teeth: the same products summed in float64, then rounded once, differ somewhere
    assert not np.array_equal(got, (x.double() @ weight.double().T).float().numpy())


_q4_weight, _q8_weight = q4_weight, q8_weight


BLOCK_FORMATS = [("4-bit", _q4_weight, native_kernels.pack_blocks, torch.uint8, 320),
                 ("8-bit", _q8_weight, native_kernels.pack_byte_blocks, torch.int8, 544)]


@needs_native
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name, make, packer, dtype, block_bytes", BLOCK_FORMATS, ids=[f[0] for f in BLOCK_FORMATS])
def test_blocks_give_the_float32_panels_bits(bias, name, make, packer, dtype, block_bytes):
    """A Q4_1-style weight is packed as 4-bit blocks (5 bits a weight to stream), a Q8_0-style one as
    8-bit blocks (8.5 bits), and every output is bit for bit what the float32 panels give: for every
    tile shape, alone or in any block, on two threads."""
    weight = make(200, 576, seed=3)  # 200 outputs: panels padded to 256, a ragged last tile
    b = torch.randn(200) if bias else None
    layer = NativeLinear(native, weight, b)
    assert layer.panels.dtype == dtype and layer.panels.shape == (16, 576 // 32, block_bytes)
    assert f"{name} block" in repr(layer)
    panels = native.pack(weight, False)  # float32
    assert layer.panels.numel() * 32 <= panels.numel() * 4 * 8.5  # at most 8.5 of the 32 bits a weight
    block = torch.randn(40, 576)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for rows in (1, 2, 3, 5, 6, 7, 11, 12, 13, 24, 25, 40):
            assert torch.equal(layer(block[:rows]), native.linear(block[:rows], panels, b, 200)), rows
        try:
            torch.set_num_threads(2)
            assert torch.equal(layer(block), native.linear(block, panels, b, 200))
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("name, make, packer, dtype, block_bytes", BLOCK_FORMATS, ids=[f[0] for f in BLOCK_FORMATS])
def test_only_weights_that_rebuild_exactly_become_blocks(name, make, packer, dtype, block_bytes):
    weight = make(64, 96, seed=4)
    assert packer(weight) is not None
    nudged = weight.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(1.0))  # one weight one ulp off its level
    assert packer(nudged) is None
    assert packer(torch.randn(64, 96)) is None  # an ordinary float32 weight
    assert packer(make(64, 96, seed=4)[:, :80]) is None  # inputs not in blocks of 32
    assert packer(torch.zeros(64, 96)) is not None  # all-zero blocks are both kinds (d = 0)
    if native is not None:
        assert NativeLinear(native, nudged, None).panels.dtype == torch.float32  # which stays float32 panels


def test_the_two_block_kinds_do_not_take_each_others_weights():
    assert native_kernels.pack_byte_blocks(_q4_weight(64, 96, seed=5)) is None
    assert native_kernels.pack_blocks(_q8_weight(64, 96, seed=5)) is None


@needs_native
def test_a_target_of_blocks_decodes_exactly_as_with_float32_panels(monkeypatch):
    """A tiny model whose decoder weights are Q4_1-style and whose LM head is Q8_0-style (as the embedded
    default's): on 4-bit and 8-bit blocks (the lean forward included) its logits for a prompt, a verified
    chain and a tree are bit for bit those of the float32 panels."""
    def quantised():
        model = tiny_quantised_llama(seed=0)
        _use_cpu_kernels(model, "native", torch.float32, lambda *a: None)
        return model

    def logits(model):
        ids = tiny_tokenizer()(PROMPT)["input_ids"]
        target = CachedModel(model)
        target.prefill(ids)
        chain = target.forward(ids, ids[:4], 5)
        target.truncate(len(ids) - 1)
        tree = target.forward_tree(ids, [ids[-1], ids[1], ids[0], ids[3], ids[1]], [-1, 0, 0, 1, 2])
        return chain, tree

    blocks = quantised()
    assert blocks.model.layers[0].mlp.down_proj.panels.dtype == torch.uint8
    assert blocks.lm_head.panels.dtype == torch.int8
    assert CachedModel(blocks).lean is not None  # the whole decoder in one native call, on blocks
    monkeypatch.setattr(native_kernels, "pack_blocks", lambda weight, integer=False: None)
    monkeypatch.setattr(native_kernels, "pack_byte_blocks", lambda weight, integer=False: None)
    float_panels = quantised()
    assert float_panels.model.layers[0].mlp.down_proj.panels.dtype == torch.float32
    assert float_panels.lm_head.panels.dtype == torch.float32
    for got, want in zip(logits(blocks), logits(float_panels)):
        assert torch.equal(got, want)


@needs_native
def test_a_row_gives_the_same_bits_alone_in_any_block_and_on_any_thread_count():
    torch.manual_seed(2)
    layer = NativeLinear(native, torch.randn(300, 576), torch.randn(300))
    block = torch.randn(40, 576)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        alone = torch.cat([layer(block[i : i + 1]) for i in range(40)])
        for rows in (2, 5, 6, 7, 12, 13, 24, 25, 40):  # every tile shape and the chunking past 24 rows
            assert torch.equal(layer(block[:rows]), alone[:rows]), rows
        try:
            torch.set_num_threads(2)
            assert torch.equal(layer(block), alone)
        finally:
            torch.set_num_threads(threads)


@needs_native
def test_native_linear_refuses_to_train_and_keeps_the_weight_only_when_asked():
    linear = torch.nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="no backward"):
        NativeLinear(native, linear.weight, linear.bias)(torch.randn(2, 8, requires_grad=True))
    assert NativeLinear(native, linear.weight, None).weight is None
    assert NativeLinear(native, linear.weight, None, keep_weight=True).weight is linear.weight


def test_a_kernel_that_cannot_be_built_leaves_pytorchs_kernels(monkeypatch, tmp_path):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_compiler)
    monkeypatch.setattr(native_kernels, "unsupported_reason", lambda: None)
    monkeypatch.setattr(native_kernels, "build_dir", lambda: tmp_path / "build")  # not the real build
    native_build.cache_clear()
    try:
        build = native_build()
        assert build.module is None and "could not be built here (Error building extension" in build.message
        model = tiny_llama(seed=0)
        _use_cpu_kernels(model, "auto", torch.float32, lambda *a: None)  # auto: oneDNN where it checks out
        assert native_kernel_of(model) is None
        with pytest.raises(ModelLoadError, match="native CPU kernel is not available: could not be built"):
            _use_cpu_kernels(tiny_llama(seed=0), "native", torch.float32, lambda *a: None)
    finally:
        native_build.cache_clear()


def test_the_native_kernel_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("SPECLENS_NATIVE_KERNELS", "0")
    native_build.cache_clear()
    try:
        assert native_build().module is None and "SPECLENS_NATIVE_KERNELS=0" in native_build().message
    finally:
        native_build.cache_clear()


def test_native_is_float32_only():
    with pytest.raises(ModelLoadError, match="float32 models only"):
        _use_cpu_kernels(tiny_llama(seed=0).to(torch.bfloat16), "native", torch.bfloat16, lambda *a: None)
    assert LoadOptions(cpu_kernels="native").cpu_kernels == "native"


def test_a_failing_self_check_keeps_the_kernel_out():
    class Wrong:
        @staticmethod
        def pack(weight, bfloat16):
            return weight

        @staticmethod
        def linear(x, panels, bias, out_features):
            return torch.zeros(*x.shape[:-1], out_features)

    assert "differ from F.linear" in native_kernels.self_check(Wrong)
    if native is not None:
        assert native_kernels.self_check(native) is None
        for dtype, name in ((torch.uint8, "4-bit"), (torch.int8, "8-bit")):
            class WrongBlocks:  # right on float32 and bfloat16 panels and one kind of blocks, one ulp off on the other
                pack, attention = native.pack, native.attention

                @staticmethod
                def linear(x, panels, bias, out_features):
                    out = native.linear(x, panels, bias, out_features)
                    return torch.nextafter(out, out + 1) if panels.dtype == dtype else out

            assert f"{name} blocks differ" in native_kernels.self_check(WrongBlocks)


def _reference_attention(q, k, v, allowed, scale):
    """Softmax attention in float64: q [T, H, D], k and v [G, S, D], allowed [T, S] -> [T, H, D]."""
    group = q.shape[1] // k.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[1]):
        scores = (q[:, h].double() @ k[h // group].double().T) * scale  # [T, S]
        out[:, h] = scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[h // group].double()
    return out


@needs_native
def test_native_attention_computes_softmax_attention():
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(5, 6, 32, generator=generator)  # [T, H, D]: 6 query heads over 2 key/value heads
    k, v = torch.randn(2, 2, 40, 32, generator=generator)  # [G, S, D] each
    scale = 32 ** -0.5
    causal = torch.ones(5, 40, dtype=torch.bool).tril(35)  # query t sees keys 0 .. 35 + t
    allowed = torch.rand(5, 40, generator=generator) < 0.6
    allowed[:, 0] = True
    floats = torch.zeros(5, 40).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask, want_allowed, is_causal in ((None, causal, True), (None, torch.ones(5, 40, dtype=torch.bool), False),
                                          (allowed, allowed, True), (floats, allowed, True),
                                          (torch.cat([allowed, allowed[:, :3]], 1), allowed, True)):  # a longer mask
        got = native.attention(q, k, v, mask, scale, is_causal)
        torch.testing.assert_close(got.double(), _reference_attention(q, k, v, want_allowed, scale), atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="other than 0 and -inf"):
        native.attention(q, k, v, floats + 0.5, scale, True)  # an additive bias is not a mask: refused


@needs_native
def test_native_attention_of_a_tree_node_equals_its_path_decoded_alone():
    """Node i of a tree sees the context and its ancestors, with its siblings' and cousins' keys in the
    cache in between; its result must be bit for bit that of the same query over context + path."""
    generator = torch.Generator().manual_seed(5)
    parents = [-1, 0, 0, 1, 1, 2, 3]
    n_ctx, n = 75, len(parents)  # keys past several of the kernel's spans of 32, odd and even counts
    k, v = torch.randn(2, 3, n_ctx + n, 16, generator=generator)  # [G, S, D]
    q = torch.randn(n, 6, 16, generator=generator)  # [T, H, D]: one query per node
    allowed = torch.ones(n, n_ctx + n, dtype=torch.bool)
    allowed[:, n_ctx:] = tree_attention(parents)
    block = native.attention(q, k, v, allowed, 0.25, True)
    for node in range(n):
        keys = torch.cat([torch.arange(n_ctx), n_ctx + torch.nonzero(tree_attention(parents)[node])[:, 0]])
        alone = native.attention(q[node : node + 1], k[:, keys], v[:, keys], None, 0.25, True)  # decoded: all keys
        assert torch.equal(block[node], alone[0]), node


@needs_native
def test_attention_the_kernel_refuses_falls_back_to_sdpa():
    class Attention:
        num_key_value_groups = 2
        is_causal = True

    generator = torch.Generator().manual_seed(6)
    query = torch.randn(1, 4, 3, 16, generator=generator)  # [B, H, T, D]
    key, value = torch.randn(2, 1, 2, 9, 16, generator=generator)  # [B, G, S, D] each
    bias = torch.randn(1, 1, 3, 9, generator=generator)  # additive scores, not a mask
    got, _ = _native_attention(Attention(), query, key, value, bias, scaling=0.25)
    want = grouped_query_attention(query, key, value, bias, 0.25).transpose(1, 2)  # [B, T, H, D]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _native_tiny(seed=0):
    model = tiny_llama(seed=seed)
    _use_cpu_kernels(model, "native", torch.float32, lambda *a: None)
    assert model.config._attn_implementation == "speclens_native"
    return model


@needs_native
def test_a_native_target_scores_a_block_and_a_tree_exactly_as_plain_decoding():
    """With the native linears and attention the whole forward is batch invariant: the logits of a
    verified chain or tree equal, bit for bit, those of the same tokens decoded one at a time."""
    model = _native_tiny()
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    extra = ids[:5]
    decoded = CachedModel(model)
    decoded.prefill(ids)
    rows = [decoded.forward(ids + extra[:i], [], 1)[0] for i in range(len(extra) + 1)]  # one token at a time
    chain = CachedModel(model)
    chain.prefill(ids)
    assert torch.equal(chain.forward(ids, extra, len(extra) + 1), torch.stack(rows))
    # a tree whose path 0 -> 2 -> 4 -> 5 is extra[:3]: the other nodes sit between them in the cache
    tree_tokens, parents = [ids[-1], extra[1], extra[0], ids[3], extra[1], extra[2]], [-1, 0, 0, 1, 2, 4]
    tree = CachedModel(model)
    tree.prefill(ids)
    logits = tree.forward_tree(ids, tree_tokens, parents)
    for node, row in ((0, 0), (2, 1), (4, 2), (5, 3)):
        assert torch.equal(logits[node], rows[row]), node
    stock = tiny_llama(seed=0)  # and the numbers are the model's own, up to rounding
    with torch.inference_mode():
        want = stock(torch.tensor([ids + extra])).logits[0, len(ids) - 1 :]
    torch.testing.assert_close(torch.stack(rows), want, atol=1e-4, rtol=1e-4)


@needs_native
def test_drafters_follow_a_native_target():
    model = tiny_llama(seed=0)
    assert use_native_linears(model, native, keep=(model.get_output_embeddings(),)) > 0
    assert is_packed(model) and native_kernel_of(model) is native
    assert model.get_output_embeddings().weight is not None  # EAGLE's draft rows and training read it
    head = EagleHead.for_target(model.config)
    copy = drafter_module(head, model)
    layers = [m for m in copy.modules() if isinstance(m, NativeLinear)]
    assert layers and all(m.panels.dtype == torch.bfloat16 for m in layers)  # drafters stream half the bytes
    assert next(copy.parameters()).dtype == torch.float32  # and compute in float32
    assert not any(isinstance(m, NativeLinear) for m in head.modules())  # the head passed in is untouched
    rows = drafter_linear(model, model.get_output_embeddings().weight[:10], None)
    assert isinstance(rows, NativeLinear) and rows.panels.dtype == torch.bfloat16


def test_an_installation_without_the_source_says_so(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECLENS_NATIVE_KERNELS", raising=False)
    monkeypatch.delenv("SPECLENS_NATIVE_ISA", raising=False)
    monkeypatch.setattr(native_kernels, "SOURCE", tmp_path / "native_kernels.cpp")
    assert "native_kernels.cpp is missing" in native_kernels.unsupported_reason()
    assert not native_kernels.is_built()


def test_the_selftest_checks_block_invariance_and_fails_without_it(monkeypatch):
    plain = Engine(loaded(tiny_llama(seed=0), "tiny"))  # PyTorch's kernels: rounding differs, for information
    prompt = tiny_tokenizer()(PROMPT)["input_ids"]
    line, ok = block_invariance_line(plain, prompt, prompt[:6])
    assert ok and line.startswith("INFO block invariance")
    native_or_skip()
    exact = Engine(loaded(_native_tiny(), "tiny-native"))
    line, ok = block_invariance_line(exact, prompt, prompt[:6])
    assert ok and line.startswith("PASS block invariance") and "bit for bit" in line
    # the check has teeth: PyTorch's SDPA behind the native attention's name (on HF's forward, which
    # looks attention up by name; the lean forward calls the kernel itself) breaks bit-for-bit equality
    from transformers import AttentionInterface

    monkeypatch.setattr("speclens.engine.runtime.cache.lean_forward_for", lambda model: None)
    AttentionInterface.register(NATIVE_ATTENTION_NAME, _attention)
    try:
        line, ok = block_invariance_line(exact, prompt, prompt[:6])
    finally:
        AttentionInterface.register(NATIVE_ATTENTION_NAME, _native_attention)
    assert not ok and line.startswith("FAIL block invariance"), line


@needs_native
def test_a_head_size_the_attention_kernel_cannot_take_keeps_sdpa_and_the_selftest_does_not_fail():
    model = tiny_llama(seed=0, hidden=40)  # 4 heads of 10: not a multiple of the vector width
    _use_cpu_kernels(model, "native", torch.float32, lambda *a: None)
    assert native_kernel_of(model) is not None and model.config._attn_implementation != NATIVE_ATTENTION_NAME
    prompt = tiny_tokenizer()(PROMPT)["input_ids"]
    line, ok = block_invariance_line(Engine(loaded(model, "tiny-40")), prompt, prompt[:6])
    assert ok and line.startswith("INFO block invariance")


@needs_native
def test_a_damaged_build_is_redone_once(monkeypatch, tmp_path):
    folder = tmp_path / "build"
    calls = []

    def load_once_damaged(where):
        calls.append(sorted(p.name for p in where.iterdir()))
        if len(calls) == 1:
            (where / "truncated.so").write_bytes(b"\x7fELF")
            raise ImportError("truncated.so: file too short")
        return native

    monkeypatch.setattr(native_kernels, "build_dir", lambda: folder)
    monkeypatch.setattr(native_kernels, "_load", load_once_damaged)
    native_build.cache_clear()
    try:
        assert native_build().module is native
        assert calls == [[], []]  # the second attempt started from an empty folder
    finally:
        native_build.cache_clear()


@needs_native
def test_a_build_killed_midway_does_not_hang_the_next_start():
    """torch's builder waits for its `lock` file to disappear; one left by a killed build is removed."""
    (native_kernels.build_dir() / "lock").touch()
    script = "from speclens.engine.runtime.native_kernels import native_build; print(native_build().module is not None)"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.stdout.strip() == "True", run.stdout + run.stderr
    assert not (native_kernels.build_dir() / "lock").exists()


@needs_native
def test_builds_for_an_older_source_are_removed(monkeypatch, tmp_path):
    folder, old = tmp_path / "speclens_native_new", tmp_path / "speclens_native_old"
    (old / "sub").mkdir(parents=True)
    (tmp_path / "speclens_native_old.lock").touch()
    (tmp_path / "unrelated").mkdir()
    monkeypatch.setattr(native_kernels, "build_dir", lambda: folder)
    monkeypatch.setattr(native_kernels, "_load", lambda where: native)
    native_build.cache_clear()
    try:
        assert native_build().module is native
        assert sorted(p.name for p in tmp_path.iterdir()) == ["speclens_native_new", "speclens_native_new.lock", "unrelated"]
    finally:
        native_build.cache_clear()


@needs_native
def test_the_build_is_the_instruction_set_asked_for():
    """SPECLENS_NATIVE_ISA=avx2 builds the AVX2 path on an AVX-512 CPU (the test below relies on it);
    otherwise the build uses the best this CPU has."""
    if native_kernels.isa_choice() == "avx2":
        assert native.isa() == "AVX2"
    else:
        assert native.isa() == {"AVX512": "AVX-512", "AVX2": "AVX2"}[torch.backends.cpu.get_cpu_capability()]


@needs_native
@pytest.mark.skipif(native is not None and native.isa() == "AVX2", reason="this build already is the AVX2 one")
def test_the_avx2_build_passes_this_file_too():
    """Most x86 laptops have AVX2 but not AVX-512, and CI machines have AVX-512: so every test above runs
    again on an AVX2 build of the same source (its own folder in the cache; built once, about 30 s),
    blocks and all."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not avx2_build"],
        capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "SPECLENS_NATIVE_ISA": "avx2"})
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in summary and "skipped" not in summary, run.stdout[-3000:] + run.stderr[-3000:]


# --- integer kernels: rows as Q8 blocks (int8 and one scale per 32 inputs), integer dot products ---


def _row_dependence(linear, x: torch.Tensor) -> str | None:
    """None if every row of linear(x) is bit for bit the row computed alone; else the first that is not.
    (A kernel whose quantisation of a row reads another row, say one scale for the whole block, fails.)"""
    whole = linear(x)
    for i in range(x.shape[0]):
        if not torch.equal(linear(x[i : i + 1]), whole[i : i + 1]):
            return f"row {i} of {x.shape[0]} differs from the row computed alone"
    return None


def _rows_of_many_scales(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations whose rows differ in magnitude by up to 10^6: a shared quantisation scale would crush
    the small rows to zero, so it cannot hide."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]


@needs_integer
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name, make", [("4-bit", q4_weight), ("8-bit", q8_weight)], ids=["4-bit", "8-bit"])
def test_integer_kernels_compute_the_quantised_rows_times_the_exact_weights(bias, name, make):
    """Each row is rounded to Q8 blocks on its own (quantize_q8) and multiplied by the exact Q4_1/Q8_0
    weights: within float32 rounding of that product in float64, for every tile size, ragged panels and
    the chunking past 16 rows; within about 1% of the float product (what 8-bit activations cost)."""
    torch.manual_seed(3)
    weight = make(300, 576, seed=7)  # 300 outputs: 18 full panels and a ragged one
    b = torch.randn(300) if bias else None
    layer = NativeLinear(native, weight, b, integer=True)
    assert layer.integer and layer.panels.dim() == 4 and "integer" in repr(layer)
    assert not NativeLinear(native, weight, b).integer  # float blocks unless asked
    with torch.inference_mode():
        for rows in (1, 2, 5, 15, 16, 17, 33, 40):
            x = _rows_of_many_scales(rows, 576, seed=rows)
            got = layer(x)
            want = quantize_q8(x).double() @ weight.double().T + (0 if b is None else b.double())
            scale = (x.abs().double() @ weight.abs().double().T).amax(-1, keepdim=True) + 1.0
            assert ((got.double() - want).abs() / scale).max() < 1e-5, rows
            exact = x.double() @ weight.double().T + (0 if b is None else b.double())
            assert ((got.double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < 0.02, rows
            assert _row_dependence(layer, x) is None, rows


@needs_integer
@pytest.mark.parametrize("name, make", [("4-bit", q4_weight), ("8-bit", q8_weight)], ids=["4-bit", "8-bit"])
def test_16_bit_activations_are_the_two_passes_and_about_300x_nearer_the_float_product(name, make):
    """residual (--cpu-kernels integer16): each row is its Q8 blocks plus the Q8 blocks of what their
    rounding left (quantize_q16), multiplied by the exact weights; every row on its own, bit for bit."""
    weight = make(300, 576, seed=7)
    b = torch.randn(300, generator=torch.Generator().manual_seed(4))
    layer = NativeLinear(native, weight, b, integer=True, residual=True)
    eight = NativeLinear(native, weight, b, integer=True)
    assert layer.residual and not eight.residual and "16-bit activations" in repr(layer)
    assert not NativeLinear(native, weight, b, residual=True).residual  # float blocks have no activation rounding
    with torch.inference_mode():
        for rows in (1, 2, 5, 8, 9, 17, 33):
            x = _rows_of_many_scales(rows, 576, seed=rows)
            got = layer(x)
            want = quantize_q16(x).double() @ weight.double().T + b.double()
            scale = (x.abs().double() @ weight.abs().double().T).amax(-1, keepdim=True) + 1.0
            assert ((got.double() - want).abs() / scale).max() < 1e-5, rows
            exact = x.double() @ weight.double().T + b.double()
            error = ((got.double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
            error8 = ((eight(x).double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max()
            assert error < 1e-4 and error < error8 / 100, (rows, float(error), float(error8))
            assert _row_dependence(layer, x) is None, rows


@needs_integer
def test_an_integer_row_gives_the_same_bits_alone_in_any_block_and_on_any_thread_count():
    layer = NativeLinear(native, q4_weight(300, 576, seed=2), None, integer=True)
    block = _rows_of_many_scales(40, 576, seed=9)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        alone = torch.cat([layer(block[i : i + 1]) for i in range(40)])
        for rows in (2, 5, 9, 16, 17, 31, 32, 33, 40):
            assert torch.equal(layer(block[:rows]), alone[:rows]), rows
        try:
            torch.set_num_threads(1)
            assert torch.equal(layer(block), alone)
        finally:
            torch.set_num_threads(threads)


def test_the_row_check_catches_a_quantiser_that_reads_another_row():
    """The check the integer tests run has teeth: a quantiser with one scale per block of rows (instead
    of per row) passes on one row and is caught on a block; the per-row reference passes."""
    weight = q4_weight(64, 96, seed=1)

    def per_row(x):  # products as sums over one row each, so torch's own blocking cannot mix rows in
        return (quantize_q8(x).double()[:, None, :] * weight.double()[None]).sum(-1)

    def one_scale_per_block(x):
        blocks = x.view(x.shape[0], -1, 32)
        amax = blocks.abs().amax(dim=(0, 2), keepdim=True)  # reads every row of the block
        q = (torch.round(blocks * 127 / amax) * (amax / 127)).view_as(x)
        return (q.double()[:, None, :] * weight.double()[None]).sum(-1)

    x = _rows_of_many_scales(5, 96, seed=0)
    assert _row_dependence(per_row, x) is None
    assert _row_dependence(one_scale_per_block, x) is not None
    assert _row_dependence(one_scale_per_block, x[:1]) is None  # one row alone cannot show it


@needs_integer
def test_the_integer_self_check_passes_here_and_catches_a_kernel_that_mixes_rows():
    assert native_kernels.integer_self_check(native) is None

    class MixesRows:  # quantises each row against the block's largest value, as a broken tile would
        def linear(self, x, panels, bias, n, residual=False):
            x = x.clone()
            x[:, 0] = x.abs().amax()
            return native.linear(x, panels, bias, n, residual)

    assert "differ" in native_kernels.integer_self_check(MixesRows())


@needs_integer
@pytest.mark.parametrize("mode, tolerance", [("integer", 0.05), ("integer16", 5e-4)])
def test_an_integer_target_scores_a_block_and_a_tree_exactly_as_plain_decoding(mode, tolerance):
    """On the integer kernels (lean forward included) a verified chain and a tree give, bit for bit, the
    logits of the same tokens decoded one at a time; against the float32 blocks they differ by the
    rounding of activations to 8 bits (or 16) only."""
    model = tiny_quantised_llama(seed=0)
    _use_cpu_kernels(model, mode, torch.float32, lambda *a: None)
    assert model.lm_head.integer and model.model.layers[0].mlp.down_proj.integer
    assert model.lm_head.residual == model.model.layers[0].mlp.down_proj.residual == (mode == "integer16")
    assert CachedModel(model).lean is not None
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    extra = ids[:5]
    decoded = CachedModel(model)
    decoded.prefill(ids)
    rows = torch.stack([decoded.forward(ids + extra[:i], [], 1)[0] for i in range(len(extra) + 1)])
    chain = CachedModel(model)
    chain.prefill(ids)
    assert torch.equal(chain.forward(ids, extra, len(extra) + 1), rows)
    tree_tokens, parents = [ids[-1], extra[1], extra[0], ids[3], extra[1], extra[2]], [-1, 0, 0, 1, 2, 4]
    tree = CachedModel(model)
    tree.prefill(ids)
    logits = tree.forward_tree(ids, tree_tokens, parents)
    for node, row in ((0, 0), (2, 1), (4, 2), (5, 3)):
        assert torch.equal(logits[node], rows[row]), node
    floats = tiny_quantised_llama(seed=0)
    _use_cpu_kernels(floats, "native", torch.float32, lambda *a: None)
    reference = CachedModel(floats)
    reference.prefill(ids)
    want = reference.forward(ids, extra, len(extra) + 1)
    assert not torch.equal(want, rows)  # the integer path really ran
    assert ((rows - want).norm(dim=-1) / want.norm(dim=-1)).max() < tolerance


def test_integer_kernels_that_are_unavailable_are_refused_in_one_line(monkeypatch):
    native_or_skip()
    import speclens.engine.runtime.models as models_module
    monkeypatch.setattr(models_module, "native_build", lambda: native_kernels.NativeBuild(
        module=native, message="", integer="", integer_message="the self-check failed"))
    with pytest.raises(ModelLoadError, match="integer CPU kernels are not available: the self-check failed"):
        _use_cpu_kernels(tiny_quantised_llama(seed=0), "integer", torch.float32, lambda *a: None)
    model = tiny_quantised_llama(seed=0)  # auto then keeps the float blocks
    _use_cpu_kernels(model, "auto", torch.float32, lambda *a: None)
    assert not model.lm_head.integer and model.lm_head.panels.dtype == torch.int8


@needs_integer
def test_drafters_of_an_integer_target_run_the_integer_kernel_on_weights_rounded_to_q8_0(tmp_path):
    """An integer target's drafters (an EAGLE head, its draft rows) run the integer kernel too, on their
    weights rounded to Q8_0: d * q per 32 inputs, within half a level of the float weight; the head's
    outputs stay close to those of its float weights, and greedy decoding with it equals plain."""
    from speclens.engine.decoding.decode import GenerationConfig

    weight = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    rounded = native_kernels.round_to_q8_0(weight)
    step = (weight.reshape(64, 3, 32).abs().amax(-1, keepdim=True) / 127).expand(64, 3, 32).reshape(64, 96)
    assert (rounded - weight).abs().le(step * 0.51).all() and not torch.equal(rounded, weight)
    assert native_kernels.pack_byte_blocks(rounded) is not None  # exactly Q8_0-style: 8-bit blocks
    assert native_kernels.round_to_q8_0(weight[:, :40]) is None  # inputs not in blocks of 32
    model = tiny_quantised_llama(seed=0)
    _use_cpu_kernels(model, "integer", torch.float32, lambda *a: None)
    head = EagleHead.for_target(model.config)
    torch.nn.init.normal_(head.fc.weight, std=0.05)
    copy = drafter_module(head, model)
    layers = [m for m in copy.modules() if isinstance(m, NativeLinear)]
    assert layers and all(m.integer for m in layers)
    rows = drafter_linear(model, model.get_output_embeddings().weight[:10], None)
    assert isinstance(rows, NativeLinear) and rows.integer
    x = torch.randn(3, head.fc.in_features, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want, got = head.fc(x), copy.fc(x)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.05
    head.save(tmp_path / "eagle")
    engine = Engine(loaded(model, "tiny"), None, (str(tmp_path / "eagle"),))
    ids = engine.encode_chat([{"role": "user", "content": "one two three"}])
    plain = list(engine.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=16)))[-1].token_ids
    for method in ("eagle", "eagle_chain"):
        spec = list(engine.generate_ids(ids, GenerationConfig(method=method, k=3, max_new_tokens=16)))[-1]
        assert spec.token_ids == plain and spec.drafted > 0, method
