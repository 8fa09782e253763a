"""oneDNN-packed linear layers: the CPU fast path for every model SpecLens decodes with.

Decoding a small model on a CPU is bound by reading the weights once per forward, and PyTorch's
stock `nn.Linear` re-reads (and for bfloat16 re-blocks) each weight in a layout oneDNN did not choose.
Packing every weight once into oneDNN's own blocked layout (the path torch.compile's CPU backend
uses, `mkldnn::_linear_pointwise`) made one decode step of the default model 1.5x faster in float32
and flattened the cost of verifying a block of tokens (see `speclens bench --verify-cost`).

Packed weights serve inference only: the op has no backward, so a forward that would need one raises.
The plain and the speculative paths run the same packed model, so the baseline gets the same speed-up.
float32 stays the CPU default: packed bfloat16 was faster still on one machine, but its rounding
differs between a 1-token and a 5-token forward, which flipped near-tie greedy tokens and so broke
greedy equality with plain decoding on the default model.
"""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn


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


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (CPU inference only).

    `weight` stays reachable only where other code reads it (the output embedding: EAGLE's draft
    rows and training read the LM head's weight); elsewhere the packed copy replaces it.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, keep_weight: bool = False):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # opaque, not a parameter
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight = weight if keep_weight else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError("PackedLinear has no backward: train with stock kernels (cpu_kernels='stock')")
        # under autocast (training metrics) activations arrive in a lower precision than the weight
        return torch.ops.mkldnn._linear_pointwise(x.to(self.dtype), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


def pack_linears(module: nn.Module, keep: tuple[nn.Module, ...] = ()) -> int:
    """Swap every nn.Linear under module (on CPU, in a dtype the packed kernels handle) for a
    PackedLinear; linears in `keep` retain their weight attribute. Returns how many were swapped."""
    count = 0
    for name, child in list(module.named_children()):
        if type(child) is nn.Linear and child.weight.device.type == "cpu":
            setattr(module, name, PackedLinear(child.weight, child.bias, keep_weight=child in keep))
            count += 1
        else:
            count += pack_linears(child, keep)
    return count


def pack_model(model: nn.Module) -> bool:
    """Pack a loaded causal LM's linears if the kernels check out for its dtype; True if packed."""
    first = next(model.parameters())
    if first.device.type != "cpu" or not packed_kernels_work(first.dtype):
        return False
    return pack_linears(model, keep=(model.get_output_embeddings(),)) > 0


def is_packed(model: nn.Module) -> bool:
    return isinstance(model.get_output_embeddings(), PackedLinear)


def drafting_dtype(target: nn.Module) -> torch.dtype:
    """The precision drafters run in. A drafter's numbers never touch exactness (verification uses
    whatever distribution it drafted from), so with packed kernels drafters read half the bytes in
    bfloat16 even where the target stays in float32."""
    if is_packed(target) and packed_kernels_work(torch.bfloat16):
        return torch.bfloat16
    return next(target.parameters()).dtype


def drafter_module(module: nn.Module, target: nn.Module) -> nn.Module:
    """A copy of a drafter's module on the target's device in drafting_dtype, packed like the target.
    A copy, so the module passed in (for instance one being trained) keeps its nn.Linear layers."""
    module = copy.deepcopy(module).to(next(target.parameters()).device, drafting_dtype(target)).eval()
    if is_packed(target):
        pack_linears(module)
    return module


def drafter_linear(target: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A drafter's linear layer over (weight, bias): packed in drafting_dtype when the target is
    packed, else an nn.Linear sharing the given tensors."""
    if is_packed(target):
        dtype = drafting_dtype(target)
        return PackedLinear(weight.detach().to(dtype), None if bias is None else bias.detach().to(dtype))
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device, dtype=weight.dtype)
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer
