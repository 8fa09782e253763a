"""One logits-processing path, used identically for the target and every drafter.

Exactness needs p_target and p_draft to be warped the same way (temperature, top-k, top-p,
repetition penalty), and the penalty to count every emitted token, including the draft tokens that
precede a position inside a block. So a block of N rows is processed with row i seeing the
committed history plus the first i block tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speclens.engine.decoding.limits import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MAX_TOP_K, check_float, check_int


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 means off
    top_p: float = 1.0  # 1 means off
    repetition_penalty: float = 1.0  # 1 means off (CTRL-style: divide positive logits, multiply negative)

    def __post_init__(self) -> None:
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, note=" (0 is greedy)")
        check_int("top_k", self.top_k, 0, MAX_TOP_K, note=" (0 is off)")
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True, note=" (1 is off)")
        check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY, low_open=True,
                    note=" (1 is off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def seen_mask(history: torch.Tensor, block: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, V] bool: row i marks the tokens in `history` [L] and in `block[:i]` (block is [N-1])."""
    n_rows = block.shape[0] + 1
    seen = torch.zeros(n_rows, vocab, dtype=torch.bool, device=history.device)
    if history.numel():
        seen[:, history] = True
    if block.numel():
        block_hits = torch.zeros(n_rows, vocab, dtype=torch.int32, device=history.device)
        rows = torch.arange(1, n_rows, device=history.device)
        block_hits[rows, block] = 1
        seen |= block_hits.cumsum(0) > 0
    return seen


def process_logits(
    logits: torch.Tensor, params: SamplingParams, history: torch.Tensor, block: torch.Tensor
) -> torch.Tensor:
    """Penalised and warped logits [N, V] (float32; masked entries are -inf).

    logits: [N, V] raw scores; history: [L] committed token ids; block: [N-1] ids fed after the
    history (row i comes after block[:i]).
    """
    logits = logits.float()
    if params.repetition_penalty != 1.0:
        seen = seen_mask(history, block, logits.shape[-1])
        penalised = torch.where(
            logits > 0, logits / params.repetition_penalty, logits * params.repetition_penalty
        )
        logits = torch.where(seen, penalised, logits)
    if params.greedy:
        return logits
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def probs_from_logits(
    logits: torch.Tensor, params: SamplingParams, history: torch.Tensor, block: torch.Tensor
) -> torch.Tensor:
    """Processed distributions [N, V] (float32, rows sum to 1).

    For greedy params this is softmax at temperature 1 after the penalty: informative for display;
    greedy decisions use `argmax` of the same rows, which matches argmax of the processed logits.
    """
    return process_logits(logits, params, history, block).softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
