"""The decoding loop: one generator of events for speculative and plain decoding alike.

Plain autoregressive decoding is the same step with an empty draft, so the baseline gets exactly
the optimisations the speculative path gets.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from speclens.engine.decoding.drafter import Drafter
from speclens.engine.decoding.events import Event, Source, StepEvent, Summary, TokenEvent
from speclens.engine.decoding.limits import (
    MAX_K,
    MAX_NEW_TOKENS,
    MAX_SEED,
    MAX_STOP_STRINGS,
    SettingError,
    check_int,
    check_method_name,
)
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.decoding.step import speculative_step
from speclens.engine.decoding.tree import TreeDrafter, tree_step
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.detok import make_detokenizer


@dataclass(frozen=True)
class GenerationConfig:
    method: str = "lookup"
    k: int = 4
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 256
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    adaptive_k: bool = False  # adapt the draft length between 1 and k from observed acceptance

    def __post_init__(self) -> None:
        check_method_name(self.method)
        check_int("draft length k", self.k, 1, MAX_K)
        check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.sampling, SamplingParams):
            raise SettingError(f"sampling must be SamplingParams, got {self.sampling!r}")
        if not isinstance(self.stop_strings, tuple) or len(self.stop_strings) > MAX_STOP_STRINGS or not all(
                isinstance(s, str) and s for s in self.stop_strings):
            raise SettingError(f"stop strings must be a tuple of at most {MAX_STOP_STRINGS} non-empty texts, "
                               f"got {self.stop_strings!r}")
        if not isinstance(self.adaptive_k, bool):
            raise SettingError(f"adaptive_k must be true or false, got {self.adaptive_k!r}")


def next_draft_length(k: int, drafted: int, accepted: int, k_max: int) -> int:
    """The +2 / -1 schedule (HF, llama.cpp): grow after a fully accepted block, else shrink.

    K depends only on past steps, so the output distribution stays exactly the target's.
    """
    return min(k + 2, k_max) if accepted == drafted else max(k - 1, 1)


def token_source(pos: int, drafted: int, accepted: int) -> Source:
    if drafted == 0:
        return "target"
    if pos < accepted:
        return "draft_accepted"
    return "bonus" if accepted == drafted else "target_resampled"


def generate(
    target: CachedModel,
    tokenizer,
    prompt_ids: Sequence[int],
    config: GenerationConfig,
    drafter: Drafter | TreeDrafter | None = None,
    eos_ids: Sequence[int] = (),
    cancel: threading.Event | None = None,
) -> Iterator[Event]:
    """Yield a TokenEvent per emitted token, a StepEvent per verification, then one Summary.

    drafter=None is plain autoregressive decoding through the same step and sampler.
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    method = drafter.name if drafter else "ar"
    params = config.sampling
    generator = torch.Generator(device=target.device)
    if config.seed is None:
        generator.seed()  # a fresh seed for this generator alone; torch's global one is left as it was
    else:
        generator.manual_seed(config.seed)
    ids = list(prompt_ids)
    eos = set(eos_ids)
    detok = make_detokenizer(tokenizer, ids)

    # a tree drafter's k is the tree depth; both steps return the same StepResult
    step_with_drafter = tree_step if isinstance(drafter, TreeDrafter) else speculative_step
    def cancelled() -> bool:
        return cancel is not None and cancel.is_set()

    start = time.perf_counter()
    # in chunks, asking `cancelled` between them: Stop and Ctrl-C answer within a chunk on a long prompt
    if target.prefill(ids, stop=cancelled) and drafter and not cancelled():
        drafter.prefill(ids)
    prefill_s = time.perf_counter() - start
    limit = target.context_length

    new_ids: list[int] = []
    text = ""
    steps = drafted = accepted = 0
    position_drafted: list[int] = []
    position_accepted: list[int] = []
    histogram: list[int] = []
    accepted_by: Counter[str] = Counter()
    stop_reason = "max_new_tokens"
    draft_length = config.k
    done = False
    while not done:
        if cancelled():
            stop_reason = "cancelled"
            break
        if limit is not None and len(ids) >= limit:  # past it the model's positions mean nothing
            stop_reason = "context_full"
            break
        # never draft past max_new_tokens or the context: the step emits up to k + 1 tokens (grafted
        # chains excepted)
        k = min(draft_length, config.max_new_tokens - len(new_ids) - 1)
        if limit is not None:
            k = min(k, limit - len(ids) - 1)
        if k > 0 and drafter is not None:
            step = step_with_drafter(target, drafter, ids, k, params, generator)
        else:
            step = speculative_step(target, None, ids, 0, params, generator)
        steps += 1
        if config.adaptive_k and step.drafted:
            draft_length = next_draft_length(draft_length, step.drafted, step.accepted, config.k)

        emitted = 0
        for pos, token in enumerate(step.tokens):
            ids.append(token)
            new_ids.append(token)
            emitted += 1
            delta = "" if token in eos else detok.add(token)
            hit = _first_stop(text, delta, config.stop_strings)
            if hit is not None:
                delta = delta[:hit]
            text += delta
            source = token_source(pos, step.drafted, step.accepted)
            proposer = step.proposers[pos] if pos < len(step.proposers) else None
            if proposer is not None:
                accepted_by[proposer] += 1
            yield TokenEvent(token, delta, source, steps, pos, step.p_target[pos], step.p_draft[pos], proposer)
            if token in eos:
                stop_reason, done = "eos", True
            elif hit is not None:
                stop_reason, done = "stop_string", True
            elif len(new_ids) >= config.max_new_tokens:
                stop_reason, done = "max_new_tokens", True
            elif limit is not None and len(ids) >= limit:
                stop_reason, done = "context_full", True
            if done:
                break
        step_drafted, step_accepted = step.drafted, step.accepted
        if emitted < len(step.tokens):  # cut short (EOS, a stop string): the drafts after the cut were not used
            step_drafted, step_accepted = min(step.drafted, emitted), min(step.accepted, emitted)
        drafted += step_drafted
        accepted += step_accepted
        for i in range(step_drafted):
            if i >= len(position_drafted):
                position_drafted.append(0)
                position_accepted.append(0)
            position_drafted[i] += 1
            position_accepted[i] += i < step_accepted
        if step_accepted >= len(histogram):
            histogram.extend([0] * (step_accepted + 1 - len(histogram)))
        histogram[step_accepted] += 1
        yield StepEvent(
            step=steps,
            k=k,
            drafted=step_drafted,
            accepted=step_accepted,
            emitted=emitted,
            draft_s=step.draft_s,
            verify_s=step.verify_s,
            new_tokens=len(new_ids),
            elapsed_s=time.perf_counter() - start,
            tree=step_with_drafter is tree_step,
            prefill_s=prefill_s,
        )

    elapsed = time.perf_counter() - start
    decode_s = max(elapsed - prefill_s, 1e-9)
    yield Summary(
        method=method,
        new_tokens=len(new_ids),
        steps=steps,
        drafted=drafted,
        accepted=accepted,
        mean_accepted_length=len(new_ids) / steps if steps else 0.0,
        per_position_acceptance=tuple(a / d for a, d in zip(position_accepted, position_drafted)),
        accepted_length_histogram=tuple(histogram),
        tokens_per_s=len(new_ids) / decode_s,
        elapsed_s=elapsed,
        prefill_s=prefill_s,
        stop_reason=stop_reason,
        text=text,
        token_ids=tuple(new_ids),
        accepted_by=tuple(accepted_by.most_common()),
    )


def _first_stop(text: str, delta: str, stop_strings: tuple[str, ...]) -> int | None:
    """Index in delta where the earliest stop string completed by delta begins, else None."""
    if not stop_strings or not delta:
        return None
    window_start = max(0, len(text) - max(len(s) for s in stop_strings))
    window = text[window_start:] + delta
    offset = len(text) - window_start
    best = None
    for s in stop_strings:
        i = window.find(s)
        if i != -1 and i + len(s) > offset:
            cut = max(i - offset, 0)
            best = cut if best is None else min(best, cut)
    return best
