"""The interface of a trainable head kind: what the generic loop (loop.py), the evaluation
(evaluate.py) and the card (card.py) ask of EAGLE, Medusa or a new head type.

Adding a head type (say EAGLE-3) is one new module with a HeadKind subclass, listed in registry.py
and in options.KINDS; nothing else branches on the kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.evaluate import EvalSetup
    from speclens.engine.tools.train.options import TrainOptions


@dataclass(frozen=True)
class LossInputs:
    """What every loss may read besides the head and the step."""

    embed: Any  # the target's input embedding (frozen)
    lm_head: Any  # the target's LM head restricted to the training vocabulary [S, H] (frozen)
    label_index: torch.Tensor  # [V]: a token id's row in lm_head, -1 when absent
    options: TrainOptions


class HeadKind:
    """One trainable head type. Subclasses set the class attributes and implement the methods."""

    name: str  # the --kind value
    title: str  # as the model card names it, e.g. "EAGLE-1"
    unrolls: bool = False  # whether --unroll (training-time test over several drafting passes) applies
    top1_note: str = ""  # how the card qualifies the held-out top-1 agreement
    learned_from: str = "the target's own final hidden states and next-token distributions"  # the card's words
    files_note: str = "head weights only; the target's embedding and LM head are reused"

    def new_head(self, model, options: TrainOptions):
        """A fresh (or --init-from) head for the target `model`, float32, in training mode."""
        raise NotImplementedError

    def load_head(self, folder, model):
        """A trained head from `folder`, for the target `model` (float32)."""
        raise NotImplementedError

    def loss(self, head, step: list[dict], inputs: LossInputs, generator, unroll: int) -> tuple[torch.Tensor, float]:
        """The training loss over one packed step and its top-1 agreement with the target;
        generator None means evaluation (no input noise)."""
        raise NotImplementedError

    def feature_layers(self, model) -> tuple[int, ...]:
        """Target hidden states (HF indices) the head reads besides the last: samples then carry "fused"."""
        return ()

    def before_training(self, head, samples: list[dict], model, options: TrainOptions) -> None:
        """Anything the kind sets from the data before training (EAGLE-3: its draft vocabulary)."""

    def after_training(self, head, samples: list[dict], model, options: TrainOptions) -> None:
        """Anything the kind derives from the trained head and stores in its config."""

    def uses_draft_vocab(self, head) -> bool:
        """Whether the head drafts over a reduced vocabulary when --draft-vocab asks for one."""
        return True

    def set_config(self, head, key: str, value) -> None:
        """Record a fact in the head's config.json."""
        raise NotImplementedError

    def setups(self, head, options: TrainOptions) -> dict[str, EvalSetup]:
        """The decoding setups the head is evaluated with (name -> setup)."""
        raise NotImplementedError

    def architecture(self, options: TrainOptions) -> str:
        """One line for the model card."""
        raise NotImplementedError
