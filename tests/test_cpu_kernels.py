"""oneDNN- and MKL-packed CPU linears (and, for greedy equality, the native kernels): the numbers nn.Linear gives
and the same greedy outputs for every method."""

import copy

import pytest
import torch

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.events import Summary
from speclens.engine.decoding.tree import TreeShape
from speclens.engine.drafters.eagle import EagleDrafter, EagleHead
from speclens.engine.drafters.medusa import MedusaDrafter, MedusaHeads
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.cpu_kernels import (
    PackedLinear,
    drafter_linear,
    drafter_module,
    is_packed,
    mkl_blocks_work,
    native_kernel_of,
    pack_model,
    packed_kernels_work,
)
from speclens.engine.runtime.models import _use_cpu_kernels
from speclens.engine.runtime.native_kernels import NativeLinear
from tests.native import integer_or_skip, native_or_skip
from tests.tiny import hf_greedy, tiny_llama, tiny_quantised_llama, tiny_tokenizer

pytestmark = pytest.mark.skipif(not packed_kernels_work(torch.float32), reason="no oneDNN packed linear in this torch")

PROMPT = "one two three four five six one two three four"
PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_computes_what_linear_computes(dtype):
    if not packed_kernels_work(dtype):
        pytest.skip(f"packed kernels do not handle {dtype} here")
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 130).to(dtype)
    packed = PackedLinear(linear.weight, linear.bias)
    for shape in ((1, 96), (1, 7, 96), (2, 5, 96)):
        x = torch.randn(shape).to(dtype)
        with torch.inference_mode():
            want, got = linear(x).float(), packed(x).float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= tolerance


needs_mkl = pytest.mark.skipif(not mkl_blocks_work(), reason="no MKL packed linear in this torch")


@needs_mkl
@pytest.mark.parametrize("keep_plain_weight", [True, False])
def test_mkl_blocks_compute_what_linear_computes(keep_plain_weight):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 130)
    layer = PackedLinear(linear.weight, linear.bias, one_row_stock=keep_plain_weight)
    layer.add_mkl_pack(linear.weight)
    layer.keep_block_kernel(mkl=True)
    assert layer.mkl_blocks and layer.packed is None  # the oneDNN pack is dropped
    if not keep_plain_weight:
        assert layer.weight is None  # MKL reads sizes off a stand-in, not a second copy of the weight
    # row counts below, at and above the one MKL packed for, each through the packed computation
    for shape in ((1, 96), (1, 5, 96), (1, 16, 96), (2, 13, 96), (1, 40, 96)):
        x = torch.randn(shape)
        with torch.inference_mode():
            want, got = linear(x), layer(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@needs_mkl
def test_mkl_blocks_run_on_the_mkl_pack():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 130)
    layer = PackedLinear(linear.weight, linear.bias, one_row_stock=True)
    layer.add_mkl_pack(torch.zeros_like(linear.weight))  # a pack of zeros: MKL's blocks give the bias alone
    layer.keep_block_kernel(mkl=True)
    with torch.inference_mode():
        torch.testing.assert_close(layer(torch.randn(1, 5, 96)), linear.bias.expand(1, 5, 130))
        x = torch.randn(1, 96)
        torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)  # one row: stock F.linear
    back = PackedLinear(linear.weight, linear.bias)
    back.add_mkl_pack(linear.weight)
    back.keep_block_kernel(mkl=False)
    assert not back.mkl_blocks and back.mkl_packed is None and back.packed is not None


@needs_mkl
def test_pack_model_block_kernels():
    for blocks, want in (("mkl", True), ("onednn", False)):
        model = tiny_llama(seed=0)
        assert pack_model(model, one_row="packed", blocks=blocks)
        layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert layers and all(m.mkl_blocks is want for m in layers), blocks
        assert all(m.weight is None for m in layers if m is not model.get_output_embeddings())
    measured = tiny_llama(seed=0)
    assert pack_model(measured, blocks="measure")  # either kernel may win here; both compute the same
    with pytest.raises(ValueError, match="blocks"):
        pack_model(tiny_llama(seed=0), blocks="fast")


def test_one_row_stock_sends_single_rows_to_f_linear_and_blocks_to_the_packed_kernel():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 130)
    layer = PackedLinear(linear.weight, linear.bias, one_row_stock=True)
    # a packed copy of zeros: whatever goes through the packed kernel comes out as the bias alone
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(linear.weight), None)
    with torch.inference_mode():
        for shape in ((1, 96), (1, 1, 96)):
            x = torch.randn(shape)
            torch.testing.assert_close(layer(x), linear(x), atol=1e-5, rtol=1e-5)
        block = torch.randn(1, 5, 96)
        torch.testing.assert_close(layer(block), linear.bias.expand(1, 5, 130))
    assert PackedLinear(linear.weight, linear.bias).weight is None  # packed-only layers drop the plain copy


def test_pack_linears_one_row_modes():
    for mode, want in (("stock", True), ("packed", False)):
        model = tiny_llama(seed=0)
        pack_model(model, one_row=mode)
        layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert layers and all(m.one_row_stock is want for m in layers), mode
        # the target's drafters take the same mode
        head = drafter_module(EagleHead.for_target(model.config), model)
        rows = drafter_linear(model, model.get_output_embeddings().weight[:10], None)
        drafted = [m for m in head.modules() if isinstance(m, PackedLinear)] + [rows]
        assert all(m.one_row_stock is want for m in drafted), mode
    measured = tiny_llama(seed=0)
    pack_model(measured)  # "measure": each shape takes the kernel that timed faster here; either is valid
    assert is_packed(measured)
    with pytest.raises(ValueError, match="one_row"):
        pack_model(tiny_llama(seed=0), one_row="fast")


def test_a_model_that_cannot_run_the_timing_probe_still_loads_packed(monkeypatch):
    model = tiny_llama(seed=0)

    def refuse(*args, **kwargs):
        raise RuntimeError("this model needs inputs the probe does not give")

    monkeypatch.setattr(model, "forward", refuse)
    assert pack_model(model)  # "measure"
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and not any(m.one_row_stock for m in layers)
    assert all(m.weight is None for m in layers if m is not model.get_output_embeddings())
    assert model.get_output_embeddings().weight is not None  # EAGLE's draft rows and training read it
    EagleDrafter(_draft_vocab_head(model), CachedModel(model))  # what failed when packed won the timing


def _draft_vocab_head(model):
    head = EagleHead.for_target(model.config)
    head.draft_vocab = torch.arange(0, model.config.vocab_size, 2)
    return head


def test_packed_linear_refuses_to_train():
    linear = torch.nn.Linear(8, 4)
    with pytest.raises(RuntimeError, match="no backward"):
        PackedLinear(linear.weight, linear.bias)(torch.randn(2, 8, requires_grad=True))


@pytest.fixture(scope="module", params=[("packed", "onednn"), ("stock", "onednn"), ("stock", "mkl"), ("native", None), ("integer", None)],
                ids=["packed", "stock-onednn", "stock-mkl", "native", "integer"])
def models(request):
    """(stock model, packed copy); the copy's single rows run on the packed kernel or on F.linear
    (what `auto` picks per shape where stock measures faster), its blocks on oneDNN or MKL, so plain
    decoding and verification blocks may run on different kernels; or the copy runs on SpecLens's
    native linears and attention (engine/native_kernels.py), or on its integer kernels (a model of Q4_1 and
    Q8_0-style weights, as the embedded default)."""
    one_row, blocks = request.param
    if one_row == "integer":
        integer_or_skip()
        stock = tiny_quantised_llama(seed=0)
        packed = copy.deepcopy(stock)
        _use_cpu_kernels(packed, "integer", torch.float32, lambda *a: None)
        assert packed.lm_head.integer and packed.model.layers[0].self_attn.q_proj.integer
        return stock, packed
    if blocks == "mkl" and not mkl_blocks_work():
        pytest.skip("no MKL packed linear in this torch")
    stock = tiny_llama(seed=0)
    packed = copy.deepcopy(stock)
    if one_row == "native":
        native_or_skip()
        _use_cpu_kernels(packed, "native", torch.float32, lambda *a: None)
        assert native_kernel_of(packed) is not None and packed.config._attn_implementation == "speclens_native"
        return stock, packed
    assert pack_model(packed, one_row=one_row, blocks=blocks) and is_packed(packed) and not is_packed(stock)
    assert all(m.mkl_blocks == (blocks == "mkl") for m in packed.modules() if isinstance(m, PackedLinear))
    return stock, packed


def _greedy(model, drafter_factory=None, k=4, n=32):
    target = CachedModel(model)
    drafter = drafter_factory(target) if drafter_factory else None
    ids = tiny_tokenizer()(PROMPT)["input_ids"]
    events = list(generate(target, tiny_tokenizer(), ids, GenerationConfig(method="x", k=k, max_new_tokens=n), drafter))
    assert isinstance(events[-1], Summary)
    return events[-1]


def test_packed_model_keeps_the_logits_and_the_lm_head_weight(models):
    stock, packed = models
    assert packed.get_output_embeddings().weight is not None  # EAGLE's draft rows and training read it
    ids = torch.tensor([tiny_tokenizer()(PROMPT)["input_ids"]])
    with torch.inference_mode():
        got, want = packed(ids).logits, stock(ids).logits
    if getattr(packed.lm_head, "integer", False):  # activations rounded to 8 bits
        assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max() < 0.05
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_every_head_method_on_a_packed_target_equals_plain_decoding(models):
    stock, packed = models
    n = 32
    reference = hf_greedy(stock, tiny_tokenizer()(PROMPT)["input_ids"], n)
    if getattr(packed.lm_head, "integer", False):
        # other numbers (activations rounded to 8 bits): the reference is its own plain decoding. (HF's
        # forward on the same kernels rounds the float32 steps between them differently, and a different
        # hidden state rounds to other 8-bit codes, so on this random model HF's greedy drifts at token 23.)
        reference = list(_greedy(packed, n=n).token_ids)
    assert list(_greedy(packed, n=n).token_ids) == reference
    torch.manual_seed(4)
    eagle = EagleHead.for_target(packed.config)
    medusa = MedusaHeads(packed.config.hidden_size, packed.config.vocab_size, num_heads=3)
    with torch.no_grad():
        for p in [*eagle.parameters(), *medusa.parameters()]:
            if p.dim() > 1:
                p.normal_(0, 0.3)
    eagle.draft_vocab = torch.arange(0, packed.config.vocab_size, 2)  # exercises the packed draft rows
    factories = {
        "eagle_tree": lambda t: EagleDrafter(eagle, t, None, top_k=3, budget=10),
        "eagle_chain": lambda t: EagleDrafter(eagle, t, TreeShape.from_paths([[0], [0, 0], [0, 0, 0]])),
        "medusa": lambda t: MedusaDrafter(medusa, t, TreeShape.from_paths(PATHS)),
    }
    for name, factory in factories.items():
        summary = _greedy(packed, factory, n=n)
        assert list(summary.token_ids) == reference, name
        assert summary.drafted > 0, name
    drafter = factories["eagle_tree"](CachedModel(packed))
    if native_kernel_of(packed) is not None:  # drafters follow the target: integer kernels, else bfloat16 weights
        layers = [m for m in drafter.head.modules() if isinstance(m, NativeLinear)]
        if packed.lm_head.integer:
            assert layers and all(m.integer for m in layers)
        else:
            assert layers and all(m.panels.dtype == torch.bfloat16 for m in layers)
    else:
        assert any(isinstance(m, PackedLinear) for m in drafter.head.modules())  # drafters follow the target
        if packed_kernels_work(torch.bfloat16):  # and draft in bfloat16: half the bytes, exactness untouched
            assert next(drafter.head.parameters()).dtype == torch.bfloat16
    for trainable in (eagle, medusa):  # on copies: the heads passed in keep their nn.Linear layers
        assert not any(isinstance(m, (PackedLinear, NativeLinear)) for m in trainable.modules())
