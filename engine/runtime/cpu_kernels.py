"""oneDNN-packed linear layers: the CPU fast path where SpecLens's native kernel is not available.

Where it builds, a float32 model on CPU runs SpecLens's own kernel instead (engine/runtime/native_kernels.py:
faster still, and batch invariant); everything below is what `auto` falls back to, what `packed`
asks for, and what bfloat16 models use.

Decoding a small model on a CPU is bound by reading the weights once per forward, and PyTorch's
stock `nn.Linear` re-reads (and for bfloat16 re-blocks) each weight in a layout oneDNN did not choose.
Packing every weight once into oneDNN's own blocked layout (the path torch.compile's CPU backend
uses, `mkldnn::_linear_pointwise`) made one decode step of the default model 1.5x faster in float32
and flattened the cost of verifying a block of tokens (see `speclens bench --verify-cost`).

Packed weights serve inference only: the op has no backward, so a forward that would need one raises.
The plain and the speculative paths run the same packed model, so the baseline gets the same speed-up.
One-token forwards (plain decoding's whole workload) are the exception: on some CPUs stock
F.linear beats the packed kernel there (on one Intel Xeon the default model's one-token forward took
55 ms stock against 72 ms packed, while 5 tokens took 76 ms stock and 72 ms packed; on one AMD EPYC
packed won at every size). So a loaded target times its own one-token forward both ways (cold
weights, as in decoding; a micro-benchmark of one layer keeps its weight in cache and misleads), and
where stock wins its layers keep their plain weights too and run single rows through F.linear.
Drafters, whose small weights do stay in cache, choose per weight shape. Either kernel computes the
same float32 product up to rounding; tests check that greedy outputs still equal plain decoding.
Blocks of rows in float32 can also run on MKL's packed sgemm (cblas_sgemm_compute on a weight packed
once, the path torch.compile's CPU backend takes for float32 linears): on one Intel Xeon it ran the
default model's 9- and 13-token forwards 13-15% faster than oneDNN, so `auto` times a block forward
both ways at load too and keeps the faster; one MKL pack serves every row count.
float32 stays the CPU default: packed bfloat16 was faster still on one machine, but its rounding
differs between a 1-token and a 5-token forward, which flipped near-tie greedy tokens and so broke
greedy equality with plain decoding on the default model.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from speclens.engine.runtime.native_kernels import NativeLinear, round_to_q8_0, use_native_linears


@functools.cache  # a property of the torch build: checked once per dtype, not per model or drafter
def packed_kernels_work(dtype: torch.dtype) -> bool:
    """Whether oneDNN's packed linear exists in this torch build and agrees with F.linear in dtype."""
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=generator).to(dtype)  # [out, in]
        x = torch.randn(3, 32, generator=generator).to(dtype)  # [T, in]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    want = nn.functional.linear(x.float(), weight.float())
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2 * want.abs().max().item()
    return got.shape == want.shape and (got.float() - want).abs().max().item() <= tolerance


# MKL packs a weight for a row count; a pack for 16 rows ran blocks of 5-13 rows 5-15% faster than
# oneDNN on one Xeon, a pack for 1 row slower than oneDNN. A B-matrix pack serves any row count.
MKL_PACK_ROWS = 16
# auto times MKL blocks only where a third copy of the weights (plain, oneDNN, MKL) fits easily
MKL_PROBE_MAX_BYTES = 2 << 30


@functools.cache  # a property of the torch build
def mkl_blocks_work() -> bool:
    """Whether MKL's packed float32 linear exists in this torch build and agrees with F.linear."""
    if not torch.backends.mkl.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=generator)  # [out, in]
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, MKL_PACK_ROWS)
        for rows in (1, 5, 21):
            x = torch.randn(rows, 32, generator=generator)  # [rows, in]
            got = torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
            if (got - nn.functional.linear(x, weight)).abs().max().item() > 1e-4:
                return False
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() over `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@functools.cache  # a property of this machine and thread count: measured once per weight shape
def stock_wins_one_row(out_features: int, in_features: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether stock F.linear multiplies one row by an [out, in] weight at least 10% faster than the
    packed kernel here (the margin keeps near-equal kernels from flipping between runs). Timed with
    the weight in cache, as a drafter's small weights are; a target is timed whole (pack_model)."""
    generator = torch.Generator().manual_seed(0)  # not the global RNG: seeded runs stay reproducible
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)  # [out, in]
    x = torch.randn(1, in_features, generator=generator).to(dtype)  # [1, in]
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    # about 0.2 GB of reads per kernel: enough repeats to see past timer noise, a few ms for small shapes
    repeats = max(5, min(200, int(2e8 / max(weight.numel() * weight.element_size(), 1))))
    with torch.inference_mode():
        stock_fn = functools.partial(nn.functional.linear, x, weight)
        packed_fn = functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
        for fn in (stock_fn, packed_fn):
            _median_seconds(fn, 3)  # warm up
        stock = min(_median_seconds(stock_fn, repeats), _median_seconds(stock_fn, repeats))
        packed_time = min(_median_seconds(packed_fn, repeats), _median_seconds(packed_fn, repeats))
    return stock < 0.9 * packed_time


def _one_row_stock(one_row: str, shape: torch.Size, dtype: torch.dtype) -> bool:
    """Whether a layer of weight shape [out, in] sends single rows to stock F.linear in this mode."""
    return one_row == "stock" or (one_row == "measure" and stock_wins_one_row(*shape, dtype, torch.get_num_threads()))


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (CPU inference only).

    `weight` stays reachable only where other code reads it (the output embedding: EAGLE's draft
    rows and training read the LM head's weight) or where one row goes through stock F.linear
    (`one_row_stock`); elsewhere the packed copy replaces it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False,
                 one_row_stock: bool = False):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # opaque, not a parameter
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # the output embedding keeps its Parameter (other code reads that very object); a one-row
        # copy is a plain tensor, so no autograd graph grows through it
        self.weight = weight if keep_weight else weight.detach() if one_row_stock else None
        self.one_row_stock = one_row_stock
        self.mkl_packed: torch.Tensor | None = None  # MKL's pack (add_mkl_pack), for blocks on MKL
        self._mkl_sizes: torch.Tensor | None = None
        self.mkl_blocks = False

    def add_mkl_pack(self, weight: torch.Tensor) -> None:
        """Pack `weight` (this layer's, float32) for MKL too, so that blocks can switch kernels."""
        self.mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), MKL_PACK_ROWS)
        # MKL's op reads the output and input sizes off an unpacked weight; a stride-0 stand-in of
        # that shape serves where the plain copy is not kept
        self._mkl_sizes = weight.new_empty(()).expand(self.out_features, self.in_features)

    def keep_block_kernel(self, mkl: bool) -> None:
        """Run blocks on MKL (mkl) or oneDNN from now on, and drop the other kernel's pack."""
        self.mkl_blocks = mkl and self.mkl_packed is not None
        if self.mkl_blocks:
            self.packed = None
        else:
            self.mkl_packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear has no backward: train with stock kernels (cpu_kernels='stock')")
        # under autocast (training metrics) activations arrive in a lower precision than the weight
        x = x.to(self.dtype)
        if self.one_row_stock and x.numel() == self.in_features:
            return nn.functional.linear(x, self.weight, self.bias)
        if self.mkl_blocks:
            rows = x.numel() // self.in_features
            # batch size = rows: MKL computes on its pack for any row count given as the batch size
            out = torch.ops.mkl._mkl_linear(x.reshape(rows, self.in_features), self.mkl_packed, self._mkl_sizes,
                                            self.bias, rows)  # [rows, out]
            return out.reshape(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        one_row = ", one row: stock" if self.one_row_stock else ""
        kernel = "MKL" if self.mkl_blocks else "oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, packed={kernel}{one_row}"


def pack_linears(module: nn.Module, keep: tuple[nn.Module, ...] = (), one_row: str = "measure") -> int:
    """Swap every nn.Linear under module (on CPU, in a dtype the packed kernels handle) for a
    PackedLinear; linears in `keep` retain their weight attribute. one_row: "measure" (single rows
    take the faster kernel for the layer's shape, see stock_wins_one_row), "packed" or "stock".
    Returns how many were swapped."""
    if one_row not in ("measure", "packed", "stock"):
        raise ValueError(f"one_row must be measure, packed or stock, not {one_row!r}")
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.weight.device.type == "cpu":
            stock = _one_row_stock(one_row, child.weight.shape, child.weight.dtype)
            setattr(module, name, PackedLinear(child.weight, child.bias, child in keep, one_row_stock=stock))
            count += 1
        else:
            count += pack_linears(child, keep, one_row)
    return count


def pack_model(model: nn.Module, one_row: str = "measure", blocks: str = "onednn") -> bool:
    """Pack a loaded causal LM's linears if the kernels check out for its dtype; True if packed.
    one_row "measure" times the model's one-token forward with single rows on stock and on packed
    kernels and keeps the faster (stock only if it wins by 5%: near-equal kernels must not flip
    between runs). Its drafters' layers follow the same mode (one_row_mode). blocks: "onednn",
    "mkl" (float32 where MKL's packed linear checks out, else oneDNN) or "measure" (a block forward
    timed on both, MKL kept only if it wins by 5%; models over MKL_PROBE_MAX_BYTES stay on oneDNN)."""
    if blocks not in ("measure", "onednn", "mkl"):
        raise ValueError(f"blocks must be measure, onednn or mkl, not {blocks!r}")
    first = next(model.parameters())
    if first.device.type != "cpu" or not packed_kernels_work(first.dtype):
        return False
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    use_mkl = blocks != "onednn" and first.dtype == torch.float32 and mkl_blocks_work()
    use_mkl = use_mkl and (blocks == "mkl" or weight_bytes <= MKL_PROBE_MAX_BYTES)
    model.speclens_one_row = one_row
    keep = (model.get_output_embeddings(),)
    if one_row != "measure" and not use_mkl:
        return pack_linears(model, keep, one_row) > 0
    if pack_linears(model, keep, "stock") == 0:  # every layer keeps its plain weight until decided
        return False
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if use_mkl:
        for layer in layers:
            layer.add_mkl_pack(layer.weight)
        mkl = blocks == "mkl" or _mkl_blocks_faster(model)
        for layer in layers:
            layer.keep_block_kernel(mkl)
    if one_row == "measure":
        try:
            stock, packed = one_token_seconds(model)
        except (RuntimeError, TypeError, ValueError):  # a model that cannot run this probe decodes packed
            stock, packed = 1.0, 0.0
        one_row_stock = stock < 0.95 * packed
    else:
        one_row_stock = one_row == "stock"
    if not one_row_stock:
        output = model.get_output_embeddings()  # now the PackedLinear that replaced keep[0]
        for layer in layers:
            layer.one_row_stock = False
            if layer is not output:
                layer.weight = None  # the plain copy is not needed any more
    return True


def _mkl_blocks_faster(model: nn.Module, rows: int = 9) -> bool:
    """Whether a forward of `rows` tokens (a typical verification block) runs at least 5% faster with
    blocks on MKL than on oneDNN; timed in alternation. A model the probe cannot run stays on oneDNN."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.mkl_packed is not None]

    def use_mkl(on: bool) -> None:
        for layer in layers:
            layer.mkl_blocks = on

    try:
        mkl, onednn = _alternating_seconds(model, rows, use_mkl, warmup=1)
    except (RuntimeError, TypeError, ValueError):
        return False
    return mkl < 0.95 * onednn


def one_token_seconds(model: nn.Module) -> tuple[float, float]:
    """Median seconds of one one-token forward of a packed model with single rows on stock kernels
    and on packed kernels, measured in alternation so that a noisy neighbour slows both alike."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.weight is not None]

    def use_stock(on: bool) -> None:
        for layer in layers:
            layer.one_row_stock = on

    try:
        return _alternating_seconds(model, 1, use_stock, warmup=2)
    finally:
        use_stock(True)


def _alternating_seconds(model: nn.Module, rows: int, switch: Callable[[bool], None], warmup: int,
                         rounds: int = 5) -> tuple[float, float]:
    """Median seconds of a no-cache forward of `rows` tokens with switch(True), then switch(False),
    taken in alternation (a noisy neighbour slows both alike) after `warmup` unrecorded rounds."""
    ids = torch.zeros(1, rows, dtype=torch.long, device=next(model.parameters()).device)  # [1, rows]
    times: dict[bool, list[float]] = {True: [], False: []}
    with torch.inference_mode():
        for round_ in range(warmup + rounds):
            for on in (True, False):
                switch(on)
                start = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                if round_ >= warmup:
                    times[on].append(time.perf_counter() - start)
    return sorted(times[True])[rounds // 2], sorted(times[False])[rounds // 2]


def one_row_mode(target: nn.Module) -> str:
    return getattr(target, "speclens_one_row", "measure")


def native_kernel_of(model: nn.Module):
    """The native extension a model's linears run on (engine/runtime/native_kernels.py), or None."""
    output = model.get_output_embeddings()
    return output.kernel if isinstance(output, NativeLinear) else None


def is_packed(model: nn.Module) -> bool:
    """Whether a model's linears run on a CPU kernel of SpecLens's choosing (oneDNN/MKL-packed or native)."""
    return isinstance(model.get_output_embeddings(), (PackedLinear, NativeLinear))


def integer_target(target: nn.Module) -> bool:
    """Whether a target runs the native integer kernels (8-bit activations): its drafters' linears then
    run them too, on their weights rounded to Q8_0 (drafter_module, drafter_linear): an EAGLE or DFlash
    step on a CPU then streams a quarter of the float32 bytes and multiplies in integers, as the target
    does, instead of one float32 FMA per weight per row."""
    output = target.get_output_embeddings()
    return isinstance(output, NativeLinear) and output.integer


def drafting_dtype(target: nn.Module) -> torch.dtype:
    """The precision drafters run in. A drafter's numbers never touch exactness (verification uses
    whatever distribution it drafted from), so with oneDNN-packed kernels drafters read half the bytes
    in bfloat16 even where the target stays in float32. On the native kernel they compute in float32
    from bfloat16 weights (drafter_module, drafter_linear), which reads as few bytes."""
    if is_packed(target) and native_kernel_of(target) is None and packed_kernels_work(torch.bfloat16):
        return torch.bfloat16
    return next(target.parameters()).dtype


def drafter_module(module: nn.Module, target: nn.Module) -> nn.Module:
    """A copy of a drafter's module on the target's device in drafting_dtype, on the target's kernels.
    A copy, so the module passed in (for instance one being trained) keeps its nn.Linear layers."""
    module = copy.deepcopy(module).to(next(target.parameters()).device, drafting_dtype(target)).eval()
    native = native_kernel_of(target)
    if native is not None:
        integer = integer_target(target)
        if integer:
            for linear in (m for m in module.modules() if type(m) is nn.Linear):
                rounded = round_to_q8_0(linear.weight)
                if rounded is not None:
                    linear.weight.data = rounded  # the module is our copy
        use_native_linears(module, native, bfloat16=not integer, integer=integer)
    elif is_packed(target):
        pack_linears(module, one_row=one_row_mode(target))
    return module


def drafter_linear(target: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A drafter's linear layer over (weight, bias): on the target's kernels in drafting_dtype when the
    target runs on SpecLens's kernels, else an nn.Linear sharing the given tensors."""
    native = native_kernel_of(target)
    rounded = round_to_q8_0(weight) if native is not None and integer_target(target) else None
    if rounded is not None:
        return NativeLinear(native, rounded, bias, integer=True)
    if native is not None:
        return NativeLinear(native, weight, bias, bfloat16=True)
    if is_packed(target):
        dtype = drafting_dtype(target)
        return PackedLinear(weight.detach().to(dtype), None if bias is None else bias.detach().to(dtype),
                            one_row_stock=_one_row_stock(one_row_mode(target), weight.shape, dtype))
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer
