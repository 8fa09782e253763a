"""A head's draft vocabulary: scoring only the target's LM-head rows a head drafts from."""

from __future__ import annotations

import torch
from torch import nn

from speclens.engine.runtime.cpu_kernels import drafter_linear


def draft_vocab_rows(target, vocab: torch.Tensor | None) -> tuple[torch.Tensor | None, nn.Module]:
    """The target's LM head in drafting precision, cut to a head's draft vocabulary: (the token ids [N]
    its outputs score, None when it scores the whole vocabulary; the linear H -> N). target: CachedModel.
    Scoring only those rows is what a draft vocabulary saves; exactness never depends on it."""
    lm_head = target.model.get_output_embeddings()
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if vocab is None or vocab.numel() >= target.n_vocab:
        return None, drafter_linear(target.model, weight, bias)
    vocab = vocab[vocab < target.n_vocab].to(target.device)  # [N]
    return vocab, drafter_linear(target.model, weight[vocab], None if bias is None else bias[vocab])


def full_vocab_logits(logits: torch.Tensor, vocab: torch.Tensor | None, n_vocab: int) -> torch.Tensor:
    """Float logits [n, n_vocab] from draft_vocab_rows' outputs [n, N]: -inf outside the draft vocabulary,
    so penalties and warping see real token ids."""
    if vocab is None:
        return logits[:, :n_vocab].float()
    full = torch.full((logits.shape[0], n_vocab), float("-inf"), device=logits.device)
    full[:, vocab] = logits.float()
    return full
