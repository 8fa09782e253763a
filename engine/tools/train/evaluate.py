"""Stage 3, evaluation: mean accepted length tau (emitted tokens / target passes, greedy) on the
held-out prompts, for each decoding setup of a head (or of the datastore)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speclens.engine.tools.train.kind import HeadKind
    from speclens.engine.tools.train.options import TrainOptions


@dataclass(frozen=True)
class EvalSetup:
    description: str
    depth: int  # K of a chain drafter, the tree depth of a tree drafter
    make_drafter: Callable  # CachedModel of the target -> the drafter (heads read that model's features)


def evaluate_tau(kind: HeadKind, model, tokenizer, prompt_ids: list[list[int]], eos_ids: tuple[int, ...], head,
                 options: TrainOptions) -> dict[str, dict]:
    """Greedy decoding on held-out prompts per decoding setup of the head (see evaluate_drafters)."""
    return evaluate_drafters(model, tokenizer, prompt_ids, eos_ids, kind.setups(head, options), options.eval_tokens)


def evaluate_drafters(model, tokenizer, prompt_ids: list[list[int]], eos_ids: tuple[int, ...],
                      setups: dict[str, EvalSetup], eval_tokens: int) -> dict[str, dict]:
    """Greedy decoding on held-out prompts per setup: tau = emitted tokens / target passes, with the
    mean draft and verify time per step."""
    from tqdm import tqdm

    from speclens.engine.decoding.decode import GenerationConfig, generate
    from speclens.engine.decoding.events import StepEvent, Summary
    from speclens.engine.runtime.cache import CachedModel

    results = {}
    for name, setup in setups.items():
        target = CachedModel(model, len(tokenizer))
        drafter = setup.make_drafter(target)
        config = GenerationConfig(method=name, k=setup.depth, max_new_tokens=eval_tokens)
        new = steps = 0
        draft_s = verify_s = 0.0
        start = time.perf_counter()
        for ids in tqdm(prompt_ids, desc=f"evaluate tau, {name} (held-out)"):
            for event in generate(target, tokenizer, ids, config, drafter, eos_ids):
                if isinstance(event, StepEvent):
                    draft_s += event.draft_s
                    verify_s += event.verify_s
                elif isinstance(event, Summary):
                    new += event.new_tokens
                    steps += event.steps
        results[name] = {"description": setup.description, "tau": new / max(steps, 1), "tokens": new,
                         "target_passes": steps, "prompts": len(prompt_ids),
                         "draft_ms_per_step": 1000 * draft_s / max(steps, 1),
                         "verify_ms_per_step": 1000 * verify_s / max(steps, 1),
                         "seconds": time.perf_counter() - start}
    return results