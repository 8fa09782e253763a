"""EAGLE-1 heads: one decoder layer over fc([embed(token); feature]) that regresses the target's
next feature (smooth L1) and matches its next-token distribution through the target's LM head
(cross-entropy, weight `ce_weight`), with uniform noise on the input features. With --unroll D the
head also trains on its own predicted features over D drafting passes (training-time test, as HASS
and EAGLE-3 do)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from speclens.engine.tools.train.evaluate import EvalSetup
from speclens.engine.tools.train.kind import HeadKind, LossInputs
from speclens.engine.tools.train.loop import packed

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.options import TrainOptions


def unrolled_mask(mask: torch.Tensor, local: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask [D*N, D*N] and validity [D*N] of `depth` drafting passes over N packed
    positions, as the head meets them when it drafts `depth` tokens in a row.

    Pass 1 is teacher-forced: entry t reads (f_t, x_{t+1}) under the packed causal `mask` [N, N].
    Pass d >= 2 entry t reads the head's own pass-(d-1) prediction for f_t with x_{t+1}, like a
    drafted node d-1 levels below the committed position c = t-d+1: it sees pass-1 keys at positions
    <= c of its own sample and, for each pass j = 2..d, the one pass-j key at position c+j-1 (its
    ancestors and itself). `local` [N] is each entry's position within its sample; entries with
    fewer than d-1 predecessors have no such chain and are invalid (they attend only themselves)."""
    import torch

    n, device = mask.shape[0], mask.device
    eye = torch.eye(n, dtype=torch.bool, device=device)
    offsets = torch.arange(n, device=device)[:, None] - torch.arange(n, device=device)[None, :]  # [N, N]: t - s
    blocks = [[torch.zeros(n, n, dtype=torch.bool, device=device) for _ in range(depth)] for _ in range(depth)]
    valid = [torch.ones(n, dtype=torch.bool, device=device)]
    blocks[0][0] = mask
    for d in range(2, depth + 1):
        ok = local >= d - 1  # [N]
        blocks[d - 1][0] = mask & (offsets >= d - 1) & ok[:, None]
        for j in range(2, d + 1):
            blocks[d - 1][j - 1] = mask & (offsets == d - j) & ok[:, None]
        blocks[d - 1][d - 1] |= eye  # invalid entries attend themselves (no empty softmax rows)
        valid.append(ok)
    return torch.cat([torch.cat(row, dim=1) for row in blocks]), torch.cat(valid)


def unrolled_predictions(head, embeds: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor,
                         mask: torch.Tensor, unroll: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's predicted features [D*N, H] over D = unroll passes (see unrolled_mask) and which
    are valid [D*N]. Each pass's inputs come from the previous pass without gradient; the final
    call recomputes every pass with gradient, so all D passes train the head."""
    import torch

    n = inputs.shape[0]
    if unroll == 1:
        return head(embeds, inputs, positions, mask), torch.ones(n, dtype=torch.bool, device=inputs.device)
    full_mask, valid = unrolled_mask(mask, positions, unroll)  # [D*N, D*N], [D*N]
    pass_inputs = [inputs]
    with torch.no_grad():
        for d in range(1, unroll):
            m = d * n
            out = head(embeds.repeat(d, 1), torch.cat(pass_inputs), positions.repeat(d), full_mask[:m, :m])
            previous = out[(d - 1) * n :]  # [N, H]: pass d's output at t is its f_hat_{t+1}
            pass_inputs.append(torch.cat([previous[:1], previous[:-1]]).float())  # entry t reads f_hat_t
    predicted = head(embeds.repeat(unroll, 1), torch.cat(pass_inputs), positions.repeat(unroll), full_mask)
    return predicted, valid


def eagle_loss(head, step: list[dict], embed, lm_head, noise: float, generator,
               ce_weight: float = 0.1, unroll: int = 1) -> tuple[torch.Tensor, float]:
    """Smooth L1 on the next feature + ce_weight x cross-entropy to the target's next-token
    distribution (the latter on the answer region only), averaged over `unroll` drafting passes:
    pass d feeds the head its own features from pass d-1 (training-time test, as HASS and EAGLE-3
    do), so it learns to draft deeper than one step from features it predicted itself. Returns the
    loss and the teacher-forced (pass 1) top-1 agreement."""
    import torch
    from torch import nn

    device = embed.weight.device
    positions, mask, answer = packed(step, device)
    tokens = torch.cat([s["tokens"][1:] for s in step]).to(device)  # [N]: token_{t+1}
    inputs = torch.cat([s["features"][:-1] for s in step]).to(device).float()  # [N, H]: f_t
    targets = torch.cat([s["features"][1:] for s in step]).to(device).float()  # [N, H]: f_{t+1}
    if noise:
        scale = inputs.pow(2).mean().sqrt()
        inputs = inputs + (torch.rand(inputs.shape, generator=generator, device=device) * 2 - 1) * noise * scale
    with torch.no_grad():
        embeds = embed(tokens)  # [N, H]
        p_target = lm_head(targets[answer]).float().softmax(-1)  # [A, V]
    predicted, valid = unrolled_predictions(head, embeds, inputs, positions, mask, unroll)  # [D*N, H], [D*N]
    regression = nn.functional.smooth_l1_loss(predicted[valid].float(), targets.repeat(unroll, 1)[valid])
    answers = answer.repeat(unroll)  # [D*N]
    log_q = lm_head(predicted[answers & valid]).float().log_softmax(-1)  # [S, V], pass 1's A rows first
    if unroll > 1:  # each scored entry's target row: its answer position's, whatever the pass
        p_target = p_target[torch.arange(p_target.shape[0], device=device).repeat(unroll)[valid[answers]]]  # [S, V]
    classification = -(p_target * log_q).sum(-1).mean()
    first = int(answer.sum())  # pass 1's answer entries, all valid
    agreement = float((log_q[:first].argmax(-1) == p_target[:first].argmax(-1)).float().mean())
    return regression + ce_weight * classification, agreement


def chain_and_tree_setups(title: str, make, options: TrainOptions) -> dict[str, EvalSetup]:
    """A head's two evaluation setups: a chain of options.chain and the dynamic tree; make(target, shape=)
    builds its drafter (shape None: the dynamic tree)."""
    from speclens.engine.decoding.tree import CHAIN_PATHS, TreeShape

    chain = TreeShape.from_paths(CHAIN_PATHS).truncated(options.chain)
    return {
        "chain": EvalSetup(f"{title} chain, K={options.chain}", options.chain, functools.partial(make, shape=chain)),
        "tree": EvalSetup(f"dynamic EAGLE-2-style tree, depth {options.depth}, top-k {options.top_k}, "
                          f"budget {options.budget} nodes", options.depth, functools.partial(make, shape=None)),
    }


def _drafter(head, target, shape, options: TrainOptions):
    from speclens.engine.drafters.eagle import EagleDrafter

    return EagleDrafter(head, target, shape, top_k=options.top_k, budget=options.budget)


class EagleKind(HeadKind):
    name = "eagle"
    title = "EAGLE-1"
    unrolls = True

    def load_head(self, folder, model):
        from speclens.engine.drafters.eagle import EagleHead

        return EagleHead.load(folder).float()

    def new_head(self, model, options: TrainOptions):
        from speclens.engine.drafters.eagle import EagleHead

        config = model.config.get_text_config()
        if options.init_from:
            head = self.load_head(options.init_from, model)
            if head.config.hidden_size != config.hidden_size:
                raise ValueError(f"{options.init_from}: an EAGLE head of width {head.config.hidden_size}, "
                                 f"the target has {config.hidden_size}")
            head.draft_vocab = None  # chosen again from this run's data
            return head.train()
        head = EagleHead.for_target(model.config).float()
        if options.init_from_target:
            head.layer.load_state_dict(model.model.layers[-1].state_dict())
        return head

    def loss(self, head, step, inputs: LossInputs, generator, unroll: int):
        noise = inputs.options.feature_noise if generator is not None else 0.0
        return eagle_loss(head, step, inputs.embed, inputs.lm_head, noise, generator, inputs.options.ce_weight, unroll)

    def set_config(self, head, key: str, value) -> None:
        setattr(head.config, key, value)

    def setups(self, head, options: TrainOptions) -> dict[str, EvalSetup]:
        return chain_and_tree_setups("EAGLE", functools.partial(_drafter, head, options=options), options)

    def architecture(self, options: TrainOptions) -> str:
        start = (f"continued from {Path(options.init_from).name}" if options.init_from else
                 "layer initialised from the target's last layer" if options.init_from_target else
                 "random initialisation")
        unroll = (f"; training-time test over {options.unroll} drafting passes (passes 2+ read the head's own "
                  "predicted features)" if options.unroll > 1 else "")
        return f"one Llama decoder layer over fc([embed(token); feature]); {start}{unroll}"
