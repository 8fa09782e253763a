"""EAGLE-3 heads (engine/drafters/eagle3.py): trained to predict the target's next token directly from
a fusion of three target layers, with training-time test.

Pass 1 is teacher-forced: entry t reads fc([h_a; h_b; h_c] at t) and the embedding of token t + 1, and
its output g scores token t + 2 through the head's own norm and LM head over a draft vocabulary (the
answers' most frequent tokens; d2t maps them to the target's ids). Pass d >= 2 reads the head's own
output of pass d - 1 in place of the fused target states, exactly as EAGLE-1's unrolled passes read
its predicted features (eagle.unrolled_mask: the same attention, the same validity), so the head
learns to draft deeper than one step from what it predicted itself. The loss is the cross-entropy to
the target's next-token distribution restricted to the draft vocabulary, averaged over the passes;
there is no feature regression (EAGLE-3 predicts tokens, not features).

The draft LM head and final norm start as copies of the target's rows and norm (the head first
learns to produce something like the target's last hidden state), the layer from random weights.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from speclens.engine.tools.train.evaluate import EvalSetup
from speclens.engine.tools.train.kind import HeadKind, LossInputs
from speclens.engine.tools.train.loop import draft_vocabulary, packed

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.options import TrainOptions

DEFAULT_DRAFT_VOCAB = 8192  # when --draft-vocab is 0: a quarter of the default model's vocabulary


def eagle3_loss(head, step: list[dict], embed, lm_head, label_index, noise: float, generator,
                unroll: int = 1) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the head's draft-vocabulary distribution to the target's (restricted to the draft
    vocabulary and renormalised) on the answer region, averaged over `unroll` passes; returns the loss
    and pass 1's top-1 agreement with the target's argmax (counted over every answer entry, so a target
    argmax outside the draft vocabulary counts as a miss)."""
    import torch

    from speclens.engine.tools.train.eagle import unrolled_predictions

    device = head.fc.weight.device
    positions, mask, answer = packed(step, device)
    tokens = torch.cat([s["tokens"][1:] for s in step]).to(device)  # [N]: token_{t+1}
    fused = torch.cat([s["fused"][:-1] for s in step]).to(device).float()  # [N, 3H]: target states at t
    targets = torch.cat([s["features"][1:] for s in step]).to(device).float()  # [N, H]: final states at t + 1
    if noise:
        scale = fused.pow(2).mean().sqrt()
        fused = fused + (torch.rand(fused.shape, generator=generator, device=device) * 2 - 1) * noise * scale
    draft_rows = label_index[head.draft_vocab.to(device)]  # [N_d]: the draft tokens' rows in lm_head
    with torch.no_grad():
        embeds = embed(tokens).float()  # [N, H]
        p_target = lm_head(targets[answer]).float().softmax(-1)  # [A, S]
        argmax = p_target.argmax(-1)  # [A]: the target's next token, as a row of lm_head
        p_draft_vocab = p_target[:, draft_rows.clamp(min=0)] * (draft_rows >= 0)  # [A, N_d]
        p_draft_vocab = p_draft_vocab / p_draft_vocab.sum(-1, keepdim=True).clamp(min=1e-9)
    inputs = head.fc(fused)  # [N, H]: pass 1's inputs, with gradient into fc
    predicted, valid = unrolled_predictions(head, embeds, inputs, positions, mask, unroll)  # [D*N, H], [D*N]
    answers = answer.repeat(unroll)  # [D*N]
    log_q = head.lm_head(head.norm(predicted[answers & valid])).float().log_softmax(-1)  # [S', N_d]
    rows = torch.arange(p_draft_vocab.shape[0], device=device).repeat(unroll)[valid[answers]]
    loss = -(p_draft_vocab[rows] * log_q).sum(-1).mean()
    first = int(answer.sum())  # pass 1's answer entries, all valid
    agreement = float((draft_rows[log_q[:first].argmax(-1)] == argmax).float().mean())
    return loss, agreement


class Eagle3Kind(HeadKind):
    name = "eagle3"
    title = "EAGLE-3"
    unrolls = True
    top1_note = "; a target token outside the draft vocabulary counts as a miss"
    learned_from = ("the hidden states of three of the target's layers (low, middle, high) and its next-token "
                    "distributions")
    files_note = ("the SafeAILab / SpecForge EAGLE-3 layout: fc, midlayer, its own norm and LM head over the draft "
                  "vocabulary, d2t / t2d; the target's embedding is reused")

    def feature_layers(self, model) -> tuple[int, ...]:
        from speclens.engine.drafters.eagle3 import default_feature_layers

        return default_feature_layers(model.config.get_text_config().num_hidden_layers)

    def load_head(self, folder, model):
        from speclens.engine.drafters.eagle3 import Eagle3Head

        return Eagle3Head.load(folder).float()

    def new_head(self, model, options: TrainOptions):
        from transformers import LlamaConfig

        from speclens.engine.drafters.eagle3 import Eagle3Head

        if options.init_from:
            return self.load_head(options.init_from, model).train()
        text = model.config.get_text_config()
        keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
                "hidden_act", "vocab_size")
        config = LlamaConfig(**{k: getattr(text, k) for k in keys if getattr(text, k, None) is not None})
        size = min(options.draft_vocab or DEFAULT_DRAFT_VOCAB, text.vocab_size)
        return Eagle3Head(config, size, text.hidden_size, self.feature_layers(model)).float().train()

    def before_training(self, head, samples: list[dict], model, options: TrainOptions) -> None:
        """The draft vocabulary (the answers' most frequent tokens), and the LM head and norm copied from
        the target's."""
        import torch

        if not options.init_from:
            vocab, coverage = draft_vocabulary(samples, head.lm_head.out_features)
            vocab = vocab.to(head.d2t.device)
            with torch.no_grad():
                head.lm_head = torch.nn.Linear(head.config.hidden_size, len(vocab), bias=False)
                head.lm_head.weight.copy_(model.get_output_embeddings().weight[vocab.to(model.device)].float().cpu())
                head.norm.weight.copy_(model.model.norm.weight.float().cpu())
            head.draft_vocab = vocab
            self.set_config(head, "speclens_draft_vocab_coverage", round(coverage, 5))

    def uses_draft_vocab(self, head) -> bool:
        return False  # chosen before training (the LM head's size depends on it)

    def loss(self, head, step, inputs: LossInputs, generator, unroll: int):
        noise = inputs.options.feature_noise if generator is not None else 0.0
        return eagle3_loss(head, step, inputs.embed, inputs.lm_head, inputs.label_index, noise, generator, unroll)

    def set_config(self, head, key: str, value) -> None:
        setattr(head.config, key, value)

    def setups(self, head, options: TrainOptions) -> dict[str, EvalSetup]:
        from speclens.engine.tools.train.eagle import chain_and_tree_setups

        return chain_and_tree_setups("EAGLE-3", functools.partial(_drafter, head, options=options), options)

    def architecture(self, options: TrainOptions) -> str:
        unroll = (f"; training-time test over {options.unroll} drafting passes (passes 2+ read the head's own "
                  "outputs)" if options.unroll > 1 else "")
        return ("one Llama decoder layer over [norm(embed(token)); norm(fc([h_low; h_mid; h_high]))], its own norm "
                f"and LM head over a draft vocabulary of {options.draft_vocab or DEFAULT_DRAFT_VOCAB} tokens{unroll}")


def _drafter(head, target, shape, options: TrainOptions):
    from speclens.engine.drafters.eagle3 import Eagle3Drafter

    return Eagle3Drafter(head, target, shape, top_k=options.top_k, budget=options.budget)
