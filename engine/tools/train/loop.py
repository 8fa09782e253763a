"""Stage 2, training: one loop for every head kind. Sequences are packed into steps of about
`tokens_per_step` tokens (block-diagonal causal attention), in bfloat16 autocast, with AdamW under
warm-up + cosine; the kind supplies the head and its loss. A checkpoint (weights, optimiser, epoch)
saved after every epoch makes a rerun resume."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING

from speclens.engine.tools.train.kind import LossInputs

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.kind import HeadKind
    from speclens.engine.tools.train.options import TrainOptions


def pack(samples: list[dict], order: list[int], tokens_per_step: int) -> list[list[dict]]:
    """Consecutive samples (in `order`) grouped into steps of at most tokens_per_step tokens (a
    longer sample forms a step alone)."""
    steps: list[list[dict]] = []
    size = tokens_per_step
    for i in order:
        n = int(samples[i]["tokens"].shape[0])
        if size + n > tokens_per_step:
            steps.append([])
            size = 0
        steps[-1].append(samples[i])
        size += n
    return steps


def packed(step: list[dict], device=None):
    """Position ids of the concatenated per-sample inputs t = 0..T-2, the block-diagonal causal mask
    over them and the answer region (inputs whose next-but-one token is drafted), on `device`."""
    import torch

    spans = [int(sample["tokens"].shape[0]) - 1 for sample in step]
    starts = torch.tensor([int(sample["answer_start"]) - 2 for sample in step], device=device)  # [S]
    sample_of = torch.repeat_interleave(torch.arange(len(spans), device=device),
                                        torch.tensor(spans, device=device))  # [N]
    first = torch.cumsum(torch.tensor([0] + spans[:-1], device=device), 0)  # [S]: each sample's first entry
    positions = torch.arange(len(sample_of), device=device) - first[sample_of]  # [N]
    mask = (sample_of[:, None] == sample_of[None, :]) & (positions[:, None] >= positions[None, :])  # [N, N]
    return positions, mask, positions >= starts[sample_of]  # [N], [N, N], [N]


def train(kind: HeadKind, head, samples: list[dict], options: TrainOptions, model, checkpoint: Path,
          held_out: list[dict] = ()) -> list[dict]:
    """Train the head of `kind`; per epoch it records the mean training loss and top-1 agreement and, given
    held-out samples, the top-1 agreement on them (teacher-forced, no feature noise): a training
    agreement far above the held-out one means the head learns the prompts rather than the target."""
    import torch
    from torch import nn
    from tqdm import tqdm

    embed = model.get_input_embeddings()
    device = embed.weight.device
    head.to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    # The losses score only the tokens the distilled data contains (a few thousand of the
    # vocabulary; the held-out data's too, so it can be scored): the vocabulary projection dominates
    # the cost, and the rest gets ~no target mass.
    vocab = torch.unique(torch.cat([s["tokens"] for s in [*samples, *held_out]])).to(device)  # [S]
    lm_head = nn.Linear(embed.embedding_dim, len(vocab), bias=False, device=device)
    lm_head.weight = nn.Parameter(model.get_output_embeddings().weight[vocab].detach().clone(), requires_grad=False)
    label_index = torch.full((model.get_output_embeddings().weight.shape[0],), -1, dtype=torch.long,
                             device=device)  # [V]
    label_index[vocab] = torch.arange(len(vocab), device=device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = len(pack(samples, list(range(len(samples))), options.tokens_per_step))
    total = max(options.epochs * steps_per_epoch, 1)
    warmup = max(total // 20, 1)

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(total - warmup, 1)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    history: list[dict] = []
    start_epoch = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True, map_location=device)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        start_epoch, history = int(state["epoch"]), json.loads(state["history"])

    inputs = LossInputs(embed, lm_head, label_index, options)

    def step_loss(step: list[dict], generator, unroll: int = options.unroll) -> tuple[torch.Tensor, float]:
        """The kind's loss and top-1 agreement; generator None: evaluation (no input noise)."""
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return kind.loss(head, step, inputs, generator, unroll)

    held_steps = pack(held_out, list(range(len(held_out))), options.tokens_per_step)

    def held_out_top1() -> float | None:
        """Teacher-forced top-1 agreement on the held-out samples (pass 1 only, whatever the unroll)."""
        if not held_steps:
            return None
        head.eval()
        with torch.no_grad():
            top1 = sum(step_loss(step, None, unroll=1)[1] for step in held_steps) / len(held_steps)
        head.train()
        return top1

    head.train()
    for epoch in range(start_epoch, options.epochs):
        order = list(range(len(samples)))
        random.Random(options.seed * 1000 + epoch).shuffle(order)
        noise = torch.Generator(device=device).manual_seed(options.seed * 1000 + epoch)
        steps = pack(samples, order, options.tokens_per_step)
        loss_sum = agree_sum = 0.0
        bar = tqdm(steps, desc=f"train {options.kind} epoch {epoch + 1}/{options.epochs}")
        for step in bar:
            loss, agreement = step_loss(step, noise)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            loss_sum += float(loss.detach())
            agree_sum += agreement
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{agreement:.2f}")
        history.append({"epoch": epoch + 1, "loss": loss_sum / len(steps), "top1": agree_sum / len(steps),
                        "held_out_top1": held_out_top1()})
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch + 1, "history": json.dumps(history)},
                   checkpoint)
    head.eval()
    return history


def draft_vocabulary(samples: list[dict], n: int) -> tuple[torch.Tensor, float]:
    """The n most frequent tokens of the distilled answers (sorted ids [<= n]) and the share of
    answer tokens they cover."""
    import torch

    answers = torch.cat([s["tokens"][int(s["answer_start"]) :] for s in samples])  # [A]
    counts = torch.bincount(answers)  # [max id + 1]
    keep = counts.argsort(descending=True)[: min(n, int((counts > 0).sum()))]
    return keep.sort().values, float(counts[keep].sum()) / max(int(answers.numel()), 1)