"""DFlash parallel drafters (engine/drafters/dflash.py): trained to fill a whole block at once.

For each training sequence a few anchor positions s are drawn in the answer region. Each anchor's
block is [token_s, mask x (B - 1)] at positions s .. s + B - 1; its rows attend to the context's keys
and values at positions before s (C = hidden_norm(fc(fused target states)), projected per layer) and to
the whole block, exactly as when drafting (DFlashHead.train_forward, one mask for every anchor of a
sequence). Row i is trained, by cross-entropy through the target's LM head, towards the target's
next-token distribution at position s + i (from its final hidden state at s + i - 1), so one forward
learns to propose B - 1 tokens. Rows further into the block are harder; each counts the same.

Our default for the 135M default model is small (2 layers, blocks of 8: 7 proposals), to stay cheap on
a CPU; the layers start as copies of the target's last layers (q/k norms at 1), fc at random.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from speclens.engine.tools.train.evaluate import EvalSetup
from speclens.engine.tools.train.kind import HeadKind, LossInputs

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.options import TrainOptions

DRAFT_LAYERS = 2


def block_mask(context: int, anchors: list[int], block: int, device=None) -> torch.Tensor:
    """[A*B, P + A*B] bool: block a's rows see context positions < anchors[a] and their own block."""
    import torch

    rows = len(anchors) * block
    mask = torch.zeros(rows, context + rows, dtype=torch.bool, device=device)
    for a, s in enumerate(anchors):
        mask[a * block : (a + 1) * block, :s] = True
        mask[a * block : (a + 1) * block, context + a * block : context + (a + 1) * block] = True
    return mask


def anchors_of(sample: dict, block: int, n: int, generator) -> list[int]:
    """Up to n anchor positions s (sorted) in the answer region, each with a full block of targets
    (s + B - 1 <= T - 1) and at least one context position (s >= 1); random in training, spread evenly
    in evaluation (generator None)."""
    import torch

    first = max(int(sample["answer_start"]) - 1, 1)
    last = int(sample["tokens"].shape[0]) - block  # s + B - 1 <= T - 1
    if last < first:
        return []
    choices = last - first + 1
    if generator is None:
        picks = torch.linspace(first, last, min(n, choices)).round().long().tolist()
    else:
        picks = (first + torch.randperm(choices, generator=generator)[:n]).tolist()
    return sorted(set(picks))


def dflash_loss(head, step: list[dict], embed, lm_head, noise: float, generator,
                anchors_per_sequence: int) -> tuple[torch.Tensor, float]:
    """Mean cross-entropy of every block row to the target's distribution at its position, over the
    sequences of a step; and the rows' top-1 agreement with the target's argmax."""
    import torch

    device = head.fc.weight.device
    mask_id, block = head.mask_token_id, head.block_size
    losses, agree, rows_total = [], 0.0, 0
    cpu_generator = None if generator is None else torch.Generator().manual_seed(int(torch.randint(
        0, 2**31, (1,), generator=generator, device=generator.device)))
    for sample in step:
        anchors = anchors_of(sample, block, anchors_per_sequence, cpu_generator)
        if not anchors:
            continue
        tokens = sample["tokens"].to(device)
        fused = sample["fused"].to(device).float()  # [T, n H]: target states at every position
        final = sample["features"].to(device).float()  # [T, H]
        if noise:
            scale = fused.pow(2).mean().sqrt()
            fused = fused + (torch.rand(fused.shape, generator=generator, device=device) * 2 - 1) * noise * scale
        context_len = max(anchors)  # positions 0 .. max(s) - 1 are ever seen
        context = head.context(fused[:context_len])  # [P, H]
        ids = torch.cat([torch.cat([tokens[s : s + 1], tokens.new_full((block - 1,), mask_id)]) for s in anchors])
        positions = torch.cat([torch.arange(s, s + block, device=device) for s in anchors])  # [A*B]
        with torch.no_grad():
            embeds = embed(ids).float()  # [A*B, H]
            # row i of anchor s predicts position s + i, from the target's final state at s + i - 1
            rows = torch.cat([torch.arange(s, s + block - 1, device=device) for s in anchors])  # [A*(B-1)]
            p_target = lm_head(final[rows]).float().softmax(-1)  # [A*(B-1), S]
        out = head.train_forward(embeds, positions, context, torch.arange(context_len, device=device),
                                 block_mask(context_len, anchors, block, device))  # [A*B, H]
        keep = torch.ones(len(anchors), block, dtype=torch.bool, device=device)
        keep[:, 0] = False  # row 0 is the known token
        log_q = lm_head(out[keep.flatten()]).float().log_softmax(-1)  # [A*(B-1), S]
        losses.append(-(p_target * log_q).sum(-1))
        agree += float((log_q.argmax(-1) == p_target.argmax(-1)).float().sum())
        rows_total += int(log_q.shape[0])
    if not losses:
        return head.fc.weight.sum() * 0.0, 0.0
    return torch.cat(losses).mean(), agree / max(rows_total, 1)


class DFlashKind(HeadKind):
    name = "dflash"
    title = "DFlash"
    top1_note = ", over every row of the blocks (row i: the token i positions ahead)"
    learned_from = ("the hidden states of a few of the target's layers and its next-token distributions at every "
                    "position of sampled blocks")
    files_note = ("z-lab's DFlash layout: fc, hidden_norm, the draft layers, norm; the target's embedding and LM "
                  "head are reused")

    def feature_layers(self, model) -> tuple[int, ...]:
        from speclens.engine.drafters.dflash import default_target_layers

        layers = model.config.get_text_config().num_hidden_layers
        return tuple(i + 1 for i in default_target_layers(layers, DRAFT_LAYERS))  # outputs of those layers

    def load_head(self, folder, model):
        from speclens.engine.drafters.dflash import DFlashHead

        return DFlashHead.load(folder).float()

    def new_head(self, model, options: TrainOptions):
        from transformers import Qwen3Config

        from speclens.engine.drafters.dflash import DFlashHead, default_target_layers

        if options.init_from:
            return self.load_head(options.init_from, model).train()
        text = model.config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        config = Qwen3Config(hidden_size=text.hidden_size, intermediate_size=text.intermediate_size,
                             num_hidden_layers=DRAFT_LAYERS, num_attention_heads=text.num_attention_heads,
                             num_key_value_heads=text.num_key_value_heads, head_dim=head_dim,
                             rms_norm_eps=text.rms_norm_eps, rope_theta=getattr(text, "rope_theta", 10000.0),
                             max_position_embeddings=text.max_position_embeddings, vocab_size=text.vocab_size,
                             hidden_act=text.hidden_act, tie_word_embeddings=False)
        head = DFlashHead(config, options.block_size, text.vocab_size - 1,
                          default_target_layers(text.num_hidden_layers, DRAFT_LAYERS), text.hidden_size)
        head.num_target_layers = text.num_hidden_layers
        copied = _copy_last_layers(head, model)
        head.extra_config = {"speclens_init": "the target's last layers" if copied else "random (the target's "
                             "linears hold no plain weights to copy)"}
        return head.float().train()

    def loss(self, head, step, inputs: LossInputs, generator, unroll: int):
        noise = inputs.options.feature_noise if generator is not None else 0.0
        return dflash_loss(head, step, inputs.embed, inputs.lm_head, noise, generator, inputs.options.anchors)

    def uses_draft_vocab(self, head) -> bool:
        return False  # proposals go through the target's whole LM head

    def set_config(self, head, key: str, value) -> None:
        head.extra_config = {**getattr(head, "extra_config", {}), key: value}

    def setups(self, head, options: TrainOptions) -> dict[str, EvalSetup]:
        from speclens.engine.drafters.dflash import DFlashDrafter

        k = head.block_size - 1
        return {"block": EvalSetup(f"DFlash block of {head.block_size} ({k} proposals a step)", k,
                                   lambda target: DFlashDrafter(head, target))}

    def architecture(self, options: TrainOptions) -> str:
        return (f"{DRAFT_LAYERS} Qwen3-style layers (q/k norms) over blocks of {options.block_size} (the known token and "
                f"{options.block_size - 1} masks) attending to fc + hidden_norm of the target's fused states; "
                f"{options.anchors} blocks per sequence per step")


def _copy_last_layers(head, model) -> bool:
    """Start the draft layers as the target's last layers (q/k norms stay 1: Llama has none) and the final
    norm as the target's; the weights from the model itself, or where its linears keep none (the native
    CPU kernels hold packed blocks only) from its safetensors. False when neither has them."""
    import torch

    first = model.config.get_text_config().num_hidden_layers - len(head.layers)
    names = [f"self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    names += [f"mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    names += ["input_layernorm", "post_attention_layernorm"]
    wanted = {f"model.layers.{first + i}.{name}.weight": (i, name) for i in range(len(head.layers)) for name in names}
    wanted["model.norm.weight"] = (None, "norm")
    found = _target_tensors(model, list(wanted))
    if found is None:
        return False
    with torch.no_grad():
        for key, (i, name) in wanted.items():
            module = head.norm if i is None else head.layers[i].get_submodule(name)
            module.weight.copy_(found[key].float().cpu())
    return True


def _target_tensors(model, keys: list[str]) -> dict | None:
    """The target's tensors of these state-dict keys: its own parameters where they are plain, else read
    from the safetensors files of the folder it was loaded from; None if some cannot be found."""
    from pathlib import Path

    from safetensors import safe_open

    own = dict(model.named_parameters())
    if all(key in own for key in keys):
        return {key: own[key].detach() for key in keys}
    found: dict = {}
    for path in sorted(Path(str(getattr(model, "name_or_path", "") or ".")).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for key in set(keys) & set(f.keys()):
                found[key] = f.get_tensor(key)
    return found if len(found) == len(keys) else None
