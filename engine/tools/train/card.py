"""The model card (README.md) of a trained head: what was trained, on what, and its measured tau."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from speclens.engine.tools.train.options import TrainOptions, neutral

if TYPE_CHECKING:
    from speclens.engine.tools.train.kind import HeadKind


def sampled_phrase(options: TrainOptions) -> str:
    temperatures = options.sample_temperatures[: options.sampled_answers]
    return (f" plus {options.sampled_answers} answer(s) sampled at temperature "
            f"{', '.join(f'{t:g}' for t in temperatures)}{' in turn' if len(temperatures) > 1 else ''}"
            if options.sampled_answers else "")


def tau_row(r: dict) -> str:
    return (f"| **tau on held-out prompts, {r['description']}** | **{r['tau']:.3f}** ({r['tokens']} tokens in "
            f"{r['target_passes']} target passes over {r['prompts']} prompts; draft {r['draft_ms_per_step']:.1f} ms, "
            f"verify {r['verify_ms_per_step']:.1f} ms per step) |")


def write_card(kind: HeadKind, out: Path, options: TrainOptions, n_train: int, n_held: int, n_samples: tuple[int, int], n_tokens: int,
               n_steps: int, history: list[dict], tau: dict[str, dict], target_name: str, command: str,
               draft_vocab_coverage: float | None = None, device: str = "cpu", eval_device: str = "cpu") -> None:
    last = history[-1] if history else {}
    rows = "\n".join(tau_row(r) for r in tau.values()) or (
        "| tau on held-out prompts | not measured yet (`--eval-tokens 0`): rerun the command with "
        "`--evaluate-only` to measure it on this machine's CPU |")
    where = "CPU (float32)" if eval_device == "cpu" else f"{eval_device} (the target as the app loads it there)"
    sampled = sampled_phrase(options)
    architecture = kind.architecture(options)
    vocab_row = (f"| draft vocabulary | the {options.draft_vocab} most frequent tokens of the distilled answers "
                 f"({draft_vocab_coverage:.2%} of them); the target verifies over its whole vocabulary |\n"
                 if draft_vocab_coverage is not None else "")
    prompt_files = ", ".join(Path(p).name for p in options.prompts)
    extra = (f" Also trained on {n_samples[1]} sequences distilled the same way from other prompts: "
             + ", ".join(Path(p).name for p in options.extra_data) + "." if options.extra_data else "")
    written = (f", and {options.self_prompts} user prompts the target wrote itself (self-prompts.jsonl: the chat "
               f"template up to a user turn, sampled at temperature {options.self_prompt_temperature}, as in Magpie)"
               if options.self_prompts else "")
    teacher = (f" Prompts, answers and features came from a {options.distil_dtype} copy of the target."
               if options.distil_dtype != options.dtype else "")
    held_top1 = last.get("held_out_top1")
    held_row = (f"| final held-out top-1 agreement with the target (teacher-forced"
                f"{kind.top1_note}) | {held_top1:.3f} |\n"
                if held_top1 is not None else "")
    text = f"""# {kind.title} draft head for {target_name}

Trained by `speclens train-drafter` (self-distillation): the target answered {n_train} training
prompts with the chat template, greedily{sampled} (up to {options.answer_tokens} new tokens each),
and the head learned from {kind.learned_from}.
Prompts: {prompt_files}{written}; {n_held} other prompts of the files were
held out for the evaluation below.{extra}{teacher}

| | |
|---|---|
| kind | {options.kind}: {architecture} |
| target | {target_name} |
| training prompts / held-out | {n_train} / {n_held} |
| distilled sequences / tokens (prompt + answer) | {sum(n_samples)} / {n_tokens} |
| epochs, optimiser steps, tokens per step | {options.epochs}, {n_steps}, {options.tokens_per_step} |
| peak learning rate (warm-up + cosine) | {options.lr} |
| final training loss | {last.get('loss', float('nan')):.4f} |
| final training top-1 agreement with the target | {last.get('top1', float('nan')):.3f} |
{held_row}{vocab_row}{rows}

tau = emitted tokens / target verification passes, greedy (temperature 0), chat template, up to
{options.eval_tokens or TrainOptions.eval_tokens} new tokens per prompt; it counts the bonus/correction token, so plain decoding
has tau = 1. Greedy output is identical to plain decoding by construction. Times are per decoding
step on {where} and depend on the machine. Distillation and training ran on {device}.

Reproduce (from the repository root):

```
{command}
```

Files: `config.json`, `model.safetensors` ({kind.files_note}), `training.json` (per-epoch loss and the evaluation). Options (paths shortened to their
last part): `{json.dumps(neutral(options))}`.
"""
    (out / "README.md").write_text(text, encoding="utf-8")