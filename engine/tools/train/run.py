"""A whole `speclens train-drafter` run: distil, then train and evaluate a head (or build a
datastore), then write the card; and `--evaluate-only`, which re-measures a finished run's head."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from speclens.engine.tools.train.options import TrainOptions, command_line, load_prompts, neutral, split_prompts


def run(options: TrainOptions) -> dict:
    import torch

    from speclens.engine.runtime.models import LoadOptions, load_model, resolve_device
    from speclens.engine.session import Engine
    from speclens.engine.tools.train.distil import distil, save_shards, shard_run, shard_samples, write_self_prompts
    from speclens.engine.tools.train.evaluate import evaluate_tau
    from speclens.engine.tools.train.loop import draft_vocabulary, pack, train
    from speclens.engine.tools.train.registry import HEAD_KINDS

    kind = HEAD_KINDS.get(options.kind)  # None: the datastore, which trains nothing
    if options.unroll < 1 or (options.unroll > 1 and not (kind and kind.unrolls)):
        unrolling = ", ".join(k.name for k in HEAD_KINDS.values() if k.unrolls)
        raise ValueError(f"--unroll {options.unroll}: give 1, or 2+ drafting passes for a head of kind {unrolling}")
    torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    if options.evaluate_only:
        return evaluate_saved(options, Engine(load_model(options.target, LoadOptions(device="cpu"))))
    prompts = load_prompts(options.prompts)
    train_prompts, held_out = split_prompts(prompts, options)
    # Distillation and training run on `device`; tau is measured with the target as the app loads
    # it on that device (float32 on a CPU).
    device = str(resolve_device(options.device))
    engine = Engine(load_model(options.target, LoadOptions(device=device, dtype=options.dtype)))
    model, tokenizer = engine.target.model, engine.target.tokenizer
    held_ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in held_out]
    # Distillation may run on a bfloat16 copy (several times faster on CPUs with bf16 matrix units,
    # and on GPUs); the evaluation below always decodes with the target as the app loads it.
    teacher = model if options.distil_dtype == options.dtype else load_model(
        options.target, LoadOptions(device=device, dtype=options.distil_dtype)).model
    if options.self_prompts:
        train_prompts = train_prompts + write_self_prompts(
            teacher, tokenizer, options.self_prompts, engine.eos_ids, out / "self-prompts.jsonl",
            options.self_prompt_temperature, options.batch_size, seed=options.seed)
    encode = [engine.encode_chat([{"role": "user", "content": p}]) for p in train_prompts]
    run_name = shard_run(options, engine.target.name)
    # A data-gathering run (distil only, into shards) keeps no features: training recomputes them.
    ids_only = options.distil_only and bool(options.shards)
    state = options.data_path.with_name(options.data_path.stem + "-ids.pt") if ids_only else options.data_path
    if options.shards and not state.exists():
        # this run's shards exist but not the state that resumes them: write beside them, never over them
        folder, base, k = Path(options.shards[0]), run_name, 1
        while any(folder.glob(f"{run_name}-[0-9][0-9][0-9][0-9].safetensors")):
            k += 1
            run_name = f"{base}-r{k}"

    def on_save(done: list[dict]) -> None:  # the shards grow with the run: a stopped run keeps its answers
        save_shards(done, options, engine.target.name, run_name)

    have_greedy: frozenset[tuple[int, ...]] = frozenset()
    if options.shards:  # greedy answers other runs already hold are not made again
        from speclens.engine.tools.train.shards import read_all

        held, _ = read_all(options.shards, target=engine.target.name, skip_run=run_name)
        have_greedy = frozenset(s.tokens[: s.answer_start] for s in held if s.temperature == 0)
    layers = kind.feature_layers(model) if kind is not None else ()  # target states a kind reads besides the last
    samples = distil(teacher, encode, engine.eos_ids, options, on_save if options.shards else None,
                     features=not ids_only, have_greedy=have_greedy, layers=layers)
    written = save_shards(samples, options, engine.target.name, run_name) if options.shards else []
    if options.distil_only:
        return {"distilled": len(samples), "data": str(options.data_path), "shards": [str(p) for p in written]}
    own = len(samples)
    for path in options.extra_data:
        samples = samples + torch.load(path, weights_only=True)
    if options.shards:
        from speclens.engine.tools.train.shards import read_all

        sequences, _ = read_all(options.shards, target=engine.target.name, skip_run=run_name)
        if options.max_shard_sequences:
            sequences = sequences[: options.max_shard_sequences]
        samples = samples + shard_samples(teacher, sequences, engine.eos_ids[0], options.batch_size, len(samples),
                                          layers)
    if kind is None:
        from speclens.engine.tools.train.datastore import build_datastore

        return build_datastore(options, samples, engine, held_ids, (len(train_prompts), len(held_out), own))
    held_samples = distil(teacher, held_ids, engine.eos_ids,
                          replace(options, data=str(out / "held-out.pt"), sampled_answers=0), layers=layers)  # greedy only
    head = kind.new_head(model, options)
    kind.before_training(head, samples, model, options)
    history = train(kind, head, samples, options, model, out / "checkpoint.pt", held_samples)
    kind.after_training(head, samples, model, options)
    coverage = None
    if options.draft_vocab and kind.uses_draft_vocab(head):
        head.draft_vocab, coverage = draft_vocabulary(samples, options.draft_vocab)
        kind.set_config(head, "speclens_draft_vocab_coverage", round(coverage, 5))
    if head.draft_vocab is not None:
        head.draft_vocab = head.draft_vocab.to(model.device)  # the evaluation drafts on the target's device
    head.save(out)
    run_facts = {"n_train": len(train_prompts), "n_held": len(held_out), "n_samples": [own, len(samples) - own],
                 "n_tokens": sum(int(s["tokens"].shape[0]) for s in samples),
                 "n_steps": options.epochs * len(pack(samples, list(range(len(samples))), options.tokens_per_step)),
                 "draft_vocab_coverage": coverage, "device": device, "command": command_line(options),
                 "options": neutral(options)}
    tau = evaluate_tau(kind, model, tokenizer, held_ids, engine.eos_ids, head, options) if options.eval_tokens else {}
    return _record(kind, out, options, run_facts, history, tau, engine.target.name, device)


def _record(kind, out: Path, options: TrainOptions, run_facts: dict, history: list[dict], tau: dict[str, dict],
            target_name: str, eval_device: str) -> dict:
    """Write the model card and training.json of a trained head."""
    from speclens.engine.tools.train.card import write_card

    write_card(kind, out, options, run_facts["n_train"], run_facts["n_held"], tuple(run_facts["n_samples"]),
               run_facts["n_tokens"], run_facts["n_steps"], history, tau, target_name, run_facts["command"],
               run_facts["draft_vocab_coverage"], run_facts["device"], eval_device)
    result = {"tau": tau, "history": history, "run": run_facts}
    (out / "training.json").write_text(json.dumps(result, indent=2))
    return result


def evaluate_saved(options: TrainOptions, engine) -> dict:
    """`--evaluate-only`: tau of the head a finished run left in OUT, measured on this machine's CPU
    with the target as the app loads it (float32), on that run's own held-out prompts (its options,
    recorded in training.json, give the same split of the same --prompts files); the card and
    training.json are rewritten with it. The evaluation's own settings (eval tokens, chain, tree
    depth, top-k, budget) come from this command. Lets a head trained on a GPU machine be measured
    where it will be used."""
    out = Path(options.out)
    record_path = out / "training.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    saved = record.get("run", {}).get("options")
    if options.kind == "datastore" or saved is None:
        raise ValueError(f"{out}: no head trained by this version of train-drafter to evaluate "
                         "(--evaluate-only measures an EAGLE or Medusa head whose training.json records its run)")
    if saved["kind"] != options.kind:
        raise ValueError(f"{out} holds a {saved['kind']} head, not {options.kind}")
    if [Path(p).name for p in options.prompts] != saved["prompts"]:
        raise ValueError(f"give the run's --prompts files ({', '.join(saved['prompts'])}): its held-out prompts come from them")
    evaluation = ("eval_tokens", "depth", "top_k", "budget", "chain")
    trained = replace(options, **{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
                                  if k not in ("prompts", *evaluation)})
    _, held_out = split_prompts(load_prompts(options.prompts), trained)
    held_ids = [engine.encode_chat([{"role": "user", "content": p}]) for p in held_out]
    from speclens.engine.tools.train.evaluate import evaluate_tau
    from speclens.engine.tools.train.registry import HEAD_KINDS

    kind = HEAD_KINDS[options.kind]
    head = kind.load_head(out, engine.target.model).eval()
    tau = evaluate_tau(kind, engine.target.model, engine.target.tokenizer, held_ids, engine.eos_ids, head, trained)
    return _record(kind, out, trained, record["run"], record["history"], tau, engine.target.name, "cpu")


def cmd_train_drafter(args: argparse.Namespace) -> int:
    names = [f for f in TrainOptions.__dataclass_fields__
             if f not in ("kind", "target", "prompts", "out", "extra_data", "shards")]
    options = TrainOptions(kind=args.kind, target=args.target, prompts=tuple(args.prompts), out=args.out,
                           extra_data=tuple(args.extra_data), shards=tuple(args.shards), **{name: getattr(args, name) for name in names if name != "dtype"})
    try:
        result = run(options)
    except (OSError, ValueError) as exc:  # a missing prompts file, benchmark prompts, a damaged shard, ...
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if options.distil_only:
        print(f"distilled {result['distilled']} sequences -> {result['data']}", file=sys.stderr)
        for path in result["shards"]:
            print(f"  token-id shard -> {path}", file=sys.stderr)
        return 0
    if not result["tau"]:
        print(f"trained -> {options.out} (tau not measured: --eval-tokens 0)", file=sys.stderr)
    for name, r in result["tau"].items():
        print(f"tau on held-out prompts, {name}: {r['tau']:.3f} -> {options.out}", file=sys.stderr)
    return 0