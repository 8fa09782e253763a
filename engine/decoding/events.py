"""Typed events yielded by the decoding loop.

Everything downstream (CLI, benchmark, window, tests) consumes these; nobody re-derives provenance
from text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

Source = Literal["draft_accepted", "target_resampled", "bonus", "target"]
SOURCES: tuple[Source, ...] = ("draft_accepted", "target_resampled", "bonus", "target")


@dataclass(frozen=True)
class TokenEvent:
    """One emitted token.

    `pos` is the token's index inside the verified block (0 = first position after the committed
    prefix). `p_target` / `p_draft` are the processed probabilities of this token under the target
    row and the draft row at that position (`p_draft` is None where nothing was drafted there).
    `proposer` names the drafter whose proposal an accepted draft token was (for eagle_lookup: the
    head, prompt lookup or the datastore; a token several proposed is credited in that order);
    None for the target's own tokens.
    """

    token_id: int
    text: str
    source: Source
    step: int
    pos: int
    p_target: float
    p_draft: float | None
    proposer: str | None = None

    @property
    def accept_prob(self) -> float | None:
        """min(1, p_target / p_draft): the chance this token is accepted when it is drafted."""
        if self.p_draft is None:
            return None
        if self.p_draft <= 0.0:
            return 1.0
        return min(1.0, self.p_target / self.p_draft)


@dataclass(frozen=True)
class StepEvent:
    """One verification step (one target forward)."""

    step: int
    k: int  # draft length asked for
    drafted: int  # tokens the drafter actually proposed (lookup may propose fewer)
    accepted: int  # leading draft tokens accepted
    emitted: int  # tokens emitted by this step (accepted + correction/bonus, less any cut by a stop)
    draft_s: float
    verify_s: float
    new_tokens: int  # total emitted so far in this generation
    elapsed_s: float  # since the generation started (prefill included)
    # a token tree was verified (tree, eagle, eagle_lookup, medusa): the pass verified more tokens
    # than `drafted`, so the speedup advisor's chain model does not describe it
    tree: bool = False
    prefill_s: float = 0.0  # the prompt's prefill, within elapsed_s: decoding began at this time

    @property
    def decode_s(self) -> float:
        """Seconds since the first decoding step began (prefill left out)."""
        return self.elapsed_s - self.prefill_s


@dataclass(frozen=True)
class Summary:
    method: str
    new_tokens: int
    steps: int
    drafted: int
    accepted: int
    mean_accepted_length: float  # tau: emitted tokens per target verify pass (counts the bonus)
    per_position_acceptance: tuple[float, ...]  # P(draft token i accepted | it was drafted)
    accepted_length_histogram: tuple[int, ...]  # index n: steps that accepted exactly n drafts
    tokens_per_s: float
    elapsed_s: float
    prefill_s: float
    stop_reason: Literal["eos", "stop_string", "max_new_tokens", "cancelled", "context_full"]
    text: str
    token_ids: tuple[int, ...] = field(repr=False, default=())
    # emitted accepted draft tokens per proposer, most first (`accepted` also counts a step's
    # accepted drafts past an EOS or stop string, which are never emitted)
    accepted_by: tuple[tuple[str, int], ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


Event = Union[TokenEvent, StepEvent, Summary]
