"""Medusa-1 heads: head k (a few residual blocks sharing the target's LM head) learns token t+2+k
from the target's feature at t (cross-entropy on the answer region). After training, each head's
rank accuracy picks a sparse static tree (config.json medusa_choices)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from speclens.engine.tools.train.evaluate import EvalSetup
from speclens.engine.tools.train.kind import HeadKind, LossInputs

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.options import TrainOptions


def _medusa_pairs(sample: dict, k: int):
    """Head k's training pairs in one sample's answer region: features [M, H] at t and the tokens
    [M] at t + 2 + k; None when the sample has none."""
    tokens, features = sample["tokens"], sample["features"]  # [T], [T, H]
    first = max(int(sample["answer_start"]) - 2 - k, 0)
    n = tokens.shape[0] - 2 - k  # features 0..n-1 have a label t + 2 + k
    return (features[first:n], tokens[first + 2 + k : n + 2 + k]) if n > first else None


def medusa_loss(heads, step: list[dict], lm_head, label_index: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Mean over heads of the cross-entropy of head k at feature t against token t+2+k, on the
    answer region; lm_head scores the training vocabulary, label_index [V] maps token ids into it.
    Returns the loss and the mean top-1 accuracy over heads."""
    import torch
    from torch import nn

    device = label_index.device
    losses, hits = [], []
    for k, head in enumerate(heads):
        pairs = [p for p in (_medusa_pairs(sample, k) for sample in step) if p is not None]
        if not pairs:
            continue
        feats, labels = zip(*pairs)
        logits = heads.logits(head, torch.cat(feats).to(device).float(), lm_head)  # [M, V]
        labels = label_index[torch.cat(labels).to(device)]  # [M], positions in the training vocabulary
        losses.append(nn.functional.cross_entropy(logits.float(), labels))
        hits.append(float((logits.argmax(-1) == labels).float().mean()))
    return torch.stack(losses).mean(), sum(hits) / max(len(hits), 1)


def medusa_rank_accuracy(heads, samples: list[dict], lm_head, ranks: int = 8) -> list[list[float]]:
    """accuracy[k][r]: how often head k's rank-r token (full vocabulary) is token t+2+k, over the
    answer regions of the samples."""
    import torch

    device = lm_head.weight.device
    hits = torch.zeros(len(heads), ranks, device=device)
    counts = torch.zeros(len(heads))
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for sample in samples:
            for k, head in enumerate(heads):
                pair = _medusa_pairs(sample, k)
                if pair is None:
                    continue
                features, labels = (t.to(device) for t in pair)  # [M, H], [M]
                top = heads.logits(head, features.float(), lm_head).topk(ranks, dim=-1).indices  # [M, ranks]
                hits[k] += (top == labels[:, None]).float().sum(0)
                counts[k] += labels.shape[0]
    return (hits.cpu() / counts.clamp(min=1)[:, None]).tolist()


def _drafter(head, target, shape):
    from speclens.engine.drafters.medusa import MedusaDrafter

    return MedusaDrafter(head, target, shape)


class MedusaKind(HeadKind):
    name = "medusa"
    title = "Medusa-1"
    top1_note = ", mean over heads"

    def load_head(self, folder, model):
        from speclens.engine.drafters.medusa import MedusaHeads

        config = model.config.get_text_config()
        return MedusaHeads.load(folder, config.hidden_size, config.vocab_size)

    def new_head(self, model, options: TrainOptions):
        from speclens.engine.drafters.medusa import MedusaHeads

        if options.init_from:
            heads = self.load_head(options.init_from, model)
            layers = heads.config.get("medusa_num_layers", 1)
            if len(heads) != options.medusa_heads or layers != options.medusa_layers:
                raise ValueError(f"{options.init_from}: {len(heads)} Medusa heads of {layers} layer(s), not the "
                                 f"{options.medusa_heads} of {options.medusa_layers} asked for")
            heads.draft_vocab = None  # chosen again from this run's data
            return heads.train()
        config = model.config.get_text_config()
        return MedusaHeads(config.hidden_size, config.vocab_size, num_heads=options.medusa_heads,
                           num_layers=options.medusa_layers, shared_lm_head=True)

    def loss(self, head, step, inputs: LossInputs, generator, unroll: int):
        return medusa_loss(head, step, inputs.lm_head, inputs.label_index)

    def after_training(self, head, samples: list[dict], model, options: TrainOptions) -> None:
        from speclens.engine.drafters.medusa import sparse_tree_paths

        accuracy = medusa_rank_accuracy(head, samples[:: max(len(samples) // 40, 1)], model.get_output_embeddings())
        head.config["medusa_rank_accuracy"] = [[round(a, 4) for a in row] for row in accuracy]
        head.config["medusa_choices"] = [list(p) for p in sparse_tree_paths(accuracy, options.medusa_tree_nodes)]

    def uses_draft_vocab(self, head) -> bool:
        return bool(head.shared_lm_head)  # heads with their own LM heads score the whole vocabulary

    def set_config(self, head, key: str, value) -> None:
        head.config[key] = value

    def setups(self, head, options: TrainOptions) -> dict[str, EvalSetup]:
        from speclens.engine.decoding.tree import DEFAULT_TREE_PATHS, TreeShape

        shape = TreeShape.from_paths(DEFAULT_TREE_PATHS).truncated(options.medusa_heads)
        setups = {"tree": EvalSetup(f"static Medusa tree (speclens DEFAULT_TREE_PATHS, {len(shape.parents)} nodes, "
                                    f"depth {shape.depth})", shape.depth, functools.partial(_drafter, head, shape=shape))}
        if head.config.get("medusa_choices"):
            sparse = TreeShape.from_paths(head.config["medusa_choices"])
            setups["sparse"] = EvalSetup(f"static Medusa sparse tree of config.json medusa_choices "
                                         f"({len(sparse.parents)} nodes, depth {sparse.depth})", sparse.depth,
                                         functools.partial(_drafter, head, shape=sparse))
        return setups

    def architecture(self, options: TrainOptions) -> str:
        start = f"; continued from {Path(options.init_from).name}" if options.init_from else ""
        return (f"{options.medusa_heads} heads of {options.medusa_layers} residual block(s), sharing the "
                f"target's LM head{start}")
