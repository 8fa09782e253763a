"""`speclens train-drafter`: train EAGLE-1 or Medusa-1 heads for a target by self-distillation.

1. distil: the target answers each training prompt greedily (chat template); one more target pass
   over prompt + answer gives its final hidden states (features) at every position.
2. train: EAGLE regresses the next feature (smooth L1) and matches the target's next-token
   distribution through the target's LM head (cross-entropy, weight 0.1), with uniform noise on the
   input features; Medusa head k learns token t+2+k from the feature at t (cross-entropy).
3. evaluate: mean accepted length tau (emitted tokens / target passes, greedy) of tree decoding
   with the trained heads on held-out prompts, written into a model card README.md.

Stages are resumable: distilled data and a checkpoint (weights, optimiser, epoch) live in OUT and
are picked up by a rerun with the same arguments. Output: config.json + model.safetensors.

Only the standard library is imported at module level, so that `speclens --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("eagle", "medusa")


@dataclass(frozen=True)
class TrainOptions:
    kind: str
    target: str
    prompts: tuple[str, ...]
    out: str
    max_prompts: int = 120
    held_out: int = 12  # prompts kept for the tau evaluation
    answer_tokens: int = 64  # length of the target's distilled answers
    epochs: int = 10
    lr: float = 5e-4
    feature_noise: float = 0.1  # EAGLE: uniform noise on input features, in units of their RMS
    medusa_heads: int = 4
    depth: int = 5  # tree depth for the evaluation
    top_k: int = 4  # EAGLE dynamic tree: children per expanded node and nodes expanded per depth
    budget: int = 16  # EAGLE dynamic tree: nodes verified per step
    eval_tokens: int = 64
    threads: int = 1
    seed: int = 0
    dtype: str = "float32"


def load_prompts(paths: tuple[str, ...]) -> list[str]:
    """Self-Instruct style .jsonl (instruction + the first instance's input) or one prompt a line."""
    prompts: list[str] = []
    for path in map(Path, paths):
        if "spec-bench" in path.resolve().parts:
            raise ValueError(f"{path}: benchmark prompts must not be used for training")
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                row = json.loads(line)
                text = row.get("instruction") or row.get("prompt") or row.get("text", "")
                inputs = [i.get("input", "") for i in row.get("instances", [])]
                if inputs and inputs[0].strip():
                    text = f"{text}\n\n{inputs[0].strip()}"
            else:
                text = line
            if text.strip():
                prompts.append(text.strip())
    return prompts


def split_prompts(prompts: list[str], options: TrainOptions) -> tuple[list[str], list[str]]:
    order = list(range(len(prompts)))
    random.Random(options.seed).shuffle(order)
    chosen = [prompts[i] for i in order[: options.max_prompts + options.held_out]]
    return chosen[options.held_out :], chosen[: options.held_out]


def distil(engine, prompts: list[str], options: TrainOptions, cache_path: Path) -> list[dict]:
    """[{"tokens": [T] long, "features": [T, H]}]: the target's answers and hidden states."""
    import torch
    from tqdm import tqdm

    from engine.decode import GenerationConfig
    from engine.events import Summary

    done: list[dict] = torch.load(cache_path, weights_only=True) if cache_path.exists() else []
    model = engine.target.model
    config = GenerationConfig(method="ar", max_new_tokens=options.answer_tokens, seed=options.seed)
    for i in tqdm(range(len(done), len(prompts)), desc="distil (target answers)", initial=len(done),
                  total=len(prompts)):
        prompt_ids = engine.encode_chat([{"role": "user", "content": prompts[i]}])
        summary = [e for e in engine.generate_ids(prompt_ids, config) if isinstance(e, Summary)][0]
        ids = prompt_ids + list(summary.token_ids)
        with torch.no_grad():  # not inference_mode: training reads these tensors
            out = model(input_ids=torch.tensor([ids], device=engine.target.device), output_hidden_states=True)
        done.append({"tokens": torch.tensor(ids), "features": out.hidden_states[-1][0].float().cpu(),
                     "answer_start": torch.tensor(len(prompt_ids))})
        if (i + 1) % 10 == 0 or i + 1 == len(prompts):
            torch.save(done, cache_path)
    return done


def eagle_loss(head, sample: dict, embed: nn.Module, lm_head: nn.Module, noise: float) -> tuple[torch.Tensor, float]:
    """Smooth L1 on the next feature + 0.1 x cross-entropy to the target's next-token distribution."""
    import torch
    from torch import nn

    tokens, features = sample["tokens"], sample["features"]  # [T], [T, H]
    n = tokens.shape[0] - 1
    inputs = features[:-1]  # f_0..f_{T-2}
    if noise:
        scale = inputs.pow(2).mean().sqrt()
        inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * noise * scale
    # the vocabulary-sized term only where drafting happens: the answer (and the token before it)
    first = max(int(sample["answer_start"]) - 2, 0)
    with torch.no_grad():
        embeds = embed(tokens[1:])  # [n, H]: token_{i+1}
        p_target = lm_head(features[1 + first :]).float().softmax(-1)  # [n - first, V]
    predicted = head(embeds, inputs, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())  # [n, H]
    regression = nn.functional.smooth_l1_loss(predicted, features[1:])
    log_q = lm_head(predicted[first:]).float().log_softmax(-1)
    classification = -(p_target * log_q).sum(-1).mean()
    agreement = float((log_q.argmax(-1) == p_target.argmax(-1)).float().mean())
    return regression + 0.1 * classification, agreement


def medusa_loss(heads, sample: dict) -> tuple[torch.Tensor, float]:
    import torch
    from torch import nn

    tokens, features = sample["tokens"], sample["features"]
    losses, hits = [], []
    for k, head in enumerate(heads):
        n = tokens.shape[0] - 2 - k  # feature at t predicts token t + 2 + k
        if n <= 0:
            continue
        logits = head(features[:n])  # [n, V]
        labels = tokens[2 + k : 2 + k + n]
        losses.append(nn.functional.cross_entropy(logits, labels))
        hits.append(float((logits.argmax(-1) == labels).float().mean()))
    return torch.stack(losses).mean(), sum(hits) / max(len(hits), 1)


def train(head: nn.Module, samples: list[dict], options: TrainOptions, engine, checkpoint: Path) -> list[dict]:
    import torch
    from torch import nn
    from tqdm import tqdm

    model = engine.target.model
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    for p in model.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
    history: list[dict] = []
    start_epoch = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, history = int(state["epoch"]), json.loads(state["history"])
    gen = random.Random(options.seed)
    head.train()
    for epoch in range(start_epoch, options.epochs):
        order = list(range(len(samples)))
        gen.shuffle(order)
        total = agree = 0.0
        bar = tqdm(order, desc=f"train {options.kind} epoch {epoch + 1}/{options.epochs}")
        for i in bar:
            if options.kind == "eagle":
                loss, agreement = eagle_loss(head, samples[i], embed, lm_head, options.feature_noise)
            else:
                loss, agreement = medusa_loss(head, samples[i])
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            total += float(loss.detach())
            agree += agreement
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{agreement:.2f}")
        history.append({"epoch": epoch + 1, "loss": total / len(order), "top1": agree / len(order)})
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                    "history": json.dumps(history)}, checkpoint)
    head.eval()
    return history


def drafter_for(kind: str, head: nn.Module, target: CachedModel, options: TrainOptions):
    from engine.tree import DEFAULT_TREE_PATHS, TreeShape

    if kind == "eagle":
        from engine.drafters.eagle import EagleDrafter

        return EagleDrafter(head, target, None, top_k=options.top_k, budget=options.budget)
    from engine.drafters.medusa import MedusaDrafter

    return MedusaDrafter(head, target, TreeShape.from_paths(DEFAULT_TREE_PATHS).truncated(len(head)))


def evaluate_tau(engine, head: nn.Module, prompts: list[str], options: TrainOptions) -> dict:
    """Greedy tree decoding on held-out prompts: tau = emitted tokens / target passes."""
    from tqdm import tqdm

    from engine.cache import CachedModel
    from engine.decode import GenerationConfig, generate
    from engine.events import Summary

    target = CachedModel(engine.target.model, engine.target_lm.n_vocab)
    drafter = drafter_for(options.kind, head, target, options)
    config = GenerationConfig(method=options.kind, k=options.depth, max_new_tokens=options.eval_tokens)
    new = steps = 0
    start = time.perf_counter()
    for prompt in tqdm(prompts, desc="evaluate tau (held-out)"):
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        summary = [e for e in generate(target, engine.target.tokenizer, ids, config, drafter, engine.eos_ids)
                   if isinstance(e, Summary)][0]
        new += summary.new_tokens
        steps += summary.steps
    return {"tau": new / max(steps, 1), "tokens": new, "target_passes": steps, "prompts": len(prompts),
            "seconds": time.perf_counter() - start}


def new_head(kind: str, model, options: TrainOptions) -> nn.Module:
    import torch

    if kind == "eagle":
        from engine.drafters.eagle import EagleHead

        return EagleHead.for_target(model.config).float()
    from engine.drafters.medusa import MedusaHeads

    config = model.config.get_text_config()
    heads = MedusaHeads(config.hidden_size, config.vocab_size, num_heads=options.medusa_heads)
    with torch.no_grad():  # start each head from the target's LM head (Medusa's recipe)
        for head in heads:
            head[-1].weight.copy_(model.get_output_embeddings().weight)
    return heads


def write_card(out: Path, options: TrainOptions, n_train: int, n_held: int, history: list[dict], tau: dict,
               target_name: str) -> None:
    last = history[-1] if history else {}
    kind = "EAGLE-1" if options.kind == "eagle" else "Medusa-1"
    tree = (f"dynamic EAGLE-2-style tree, depth {options.depth}, top-k {options.top_k}, budget {options.budget} nodes"
            if options.kind == "eagle" else f"static Medusa tree (speclens default shape), depth <= {options.depth}")
    text = f"""# {kind} draft head for {target_name}

Trained by `speclens train-drafter` (self-distillation): the target answered {n_train} training prompts
greedily (up to {options.answer_tokens} tokens each), and the head learned from the target's own hidden
states and next-token distributions. Prompts: {', '.join(options.prompts)} (Self-Instruct,
Apache-2.0); {n_held} prompts were held out for evaluation.

| | |
|---|---|
| kind | {options.kind} |
| target | {target_name} |
| training prompts / held-out | {n_train} / {n_held} |
| epochs, learning rate | {options.epochs}, {options.lr} |
| final training loss | {last.get('loss', float('nan')):.4f} |
| final training top-1 agreement with the target | {last.get('top1', float('nan')):.3f} |
| **tau on held-out prompts** (greedy, {tree}) | **{tau['tau']:.3f}** ({tau['tokens']} tokens in {tau['target_passes']} target passes over {tau['prompts']} prompts) |

tau = emitted tokens / target verification passes (counts the bonus/correction token; plain decoding
has tau = 1). Greedy output is identical to plain decoding by construction.

Files: `config.json`, `model.safetensors` (head weights only; the target's embedding and LM head are
reused). Options: `{json.dumps(asdict(options))}`.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def run(options: TrainOptions) -> dict:
    import torch

    from engine.models import LoadOptions, load_model
    from engine.session import Engine

    torch.set_num_threads(options.threads)
    torch.manual_seed(options.seed)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(options.prompts)
    train_prompts, held_out = split_prompts(prompts, options)
    engine = Engine(load_model(options.target, LoadOptions(device="cpu", dtype=options.dtype)))
    samples = distil(engine, train_prompts, options, out / "distilled.pt")
    head = new_head(options.kind, engine.target.model, options)
    history = train(head, samples, options, engine, out / "checkpoint.pt")
    head.save(out)
    tau = evaluate_tau(engine, head, held_out, options)
    write_card(out, options, len(train_prompts), len(held_out), history, tau, engine.target.name)
    result = {"tau": tau, "history": history}
    (out / "training.json").write_text(json.dumps(result, indent=2))
    return result


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--prompts", action="append", required=True, help="a .jsonl or text file (repeatable)")
    parser.add_argument("--out", required=True, help="output folder (also holds resumable state)")
    defaults = TrainOptions("eagle", "", (), "")
    for name in ("max_prompts", "held_out", "answer_tokens", "epochs", "medusa_heads", "depth", "top_k", "budget",
                 "eval_tokens", "threads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--feature-noise", type=float, default=defaults.feature_noise)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    options = TrainOptions(
        kind=args.kind, target=args.target, prompts=tuple(args.prompts), out=args.out,
        max_prompts=args.max_prompts, held_out=args.held_out, answer_tokens=args.answer_tokens, epochs=args.epochs,
        lr=args.lr, feature_noise=args.feature_noise, medusa_heads=args.medusa_heads, depth=args.depth,
        top_k=args.top_k, budget=args.budget, eval_tokens=args.eval_tokens, threads=args.threads, seed=args.seed,
    )
    result = run(options)
    print(f"tau on held-out prompts: {result['tau']['tau']:.3f} -> {options.out}", file=sys.stderr)
    return 0
