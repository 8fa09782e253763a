"""Kind `datastore`: store the distilled answers for retrieval drafting (REST); nothing is trained."""

from __future__ import annotations

import json
from pathlib import Path

from speclens.engine.tools.train.card import sampled_phrase, tau_row
from speclens.engine.tools.train.evaluate import EvalSetup, evaluate_drafters
from speclens.engine.tools.train.options import TrainOptions, command_line, neutral


def build_datastore(options: TrainOptions, samples: list[dict], engine, held_ids: list[list[int]],
                    counts: tuple[int, int, int]) -> dict:
    """Kind `datastore`: store the distilled answers (no training), measure tau on the held-out
    prompts with the datastore alone and with prompt lookup alone, and write the card."""
    from speclens.engine.drafters.datastore import Datastore, DatastoreDrafter
    from speclens.engine.drafters.lookup import PromptLookupDrafter

    answers = [s["tokens"][int(s["answer_start"]):].tolist() for s in samples]
    if not any(answers):
        raise ValueError("the target gave no answer tokens to store (every answer ended at once)")
    store = Datastore.build(answers)
    out = Path(options.out)
    store.save(out, target=engine.target.name, answer_tokens=options.answer_tokens)
    setups = {
        "rest": EvalSetup(f"the datastore alone (method rest), K={options.chain}", options.chain,
                          lambda target: DatastoreDrafter(store)),
        "lookup": EvalSetup(f"prompt lookup alone, for comparison, K={options.chain}", options.chain,
                            lambda target: PromptLookupDrafter()),
    }
    tau = evaluate_drafters(engine.target.model, engine.target.tokenizer, held_ids, engine.eos_ids, setups,
                            options.eval_tokens)
    n_train, n_held, own = counts
    _write_datastore_card(out, options, store, n_train, n_held, (own, len(samples) - own), tau,
                          engine.target.name, command_line(options))
    result = {"tau": tau, "history": []}
    (out / "training.json").write_text(json.dumps(result, indent=2))
    return result


def _write_datastore_card(out: Path, options: TrainOptions, store, n_train: int, n_held: int,
                          n_samples: tuple[int, int], tau: dict[str, dict], target_name: str, command: str) -> None:
    rows = "\n".join(tau_row(r) for r in tau.values())
    prompt_files = ", ".join(Path(p).name for p in options.prompts)
    extra = (f" Also {n_samples[1]} answers distilled the same way from other prompts: "
             + ", ".join(Path(p).name for p in options.extra_data) + "." if options.extra_data else "")
    written = (f", and {options.self_prompts} user prompts the target wrote itself (self-prompts.jsonl, as in Magpie)"
               if options.self_prompts else "")
    sampled = sampled_phrase(options)
    text = f"""# Retrieval datastore for {target_name}

Built by `speclens train-drafter --kind datastore`: the target answered {n_train} training prompts
with the chat template, greedily{sampled} (up to {options.answer_tokens} new tokens each), and its answers were
stored for retrieval drafting (REST). Prompts: {prompt_files}{written}; {n_held} other prompts of the
files were held out for the evaluation below.{extra} Nothing is trained; drafts are the most frequent
continuations, in these answers, of the context's last tokens (up to {store.ngram}).

| | |
|---|---|
| target | {target_name} |
| stored answers / tokens | {store.sequences} / {store.tokens.numel() - store.sequences} |
{rows}

tau = emitted tokens / target verification passes, greedy (temperature 0), chat template, up to
{options.eval_tokens} new tokens per prompt. The datastore is most useful grafted into the EAGLE
tree next to prompt lookup's chain (method `eagle_lookup`); see the README's benchmarks.

Reproduce (from the repository root):

```
{command}
```

Files: `config.json`, `datastore.safetensors` (int32 token ids, -1 between answers), `training.json`.
Options (paths shortened to their last part): `{json.dumps(neutral(options))}`.
"""
    (out / "README.md").write_text(text, encoding="utf-8")