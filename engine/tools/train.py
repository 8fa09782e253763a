"""`speclens train-drafter`: train EAGLE-1 or Medusa-1 heads for a target by self-distillation.

1. distil: the target answers the training prompts (chat template) in left-padded batches, greedily
   and optionally also sampled at temperature 0.7; one teacher-forced pass over each batch of
   prompt + answer then gives the target's final hidden states (features) at every position.
2. train: EAGLE regresses the next feature (smooth L1) and matches the target's next-token
   distribution through the target's LM head (cross-entropy, weight `ce_weight`: 0.1 as in EAGLE by
   default), with uniform noise on the input features; its decoder layer can start from the
   target's last layer. Medusa head k learns token t+2+k from the feature at t (cross-entropy).
   Sequences are packed into steps of about `tokens_per_step` tokens (block-diagonal causal
   attention), in bfloat16 autocast.
3. evaluate: mean accepted length tau (emitted tokens / target passes, greedy) on held-out prompts,
   for each decoding setup of the head (EAGLE: a chain and a dynamic tree; Medusa: a static tree),
   written into a model card README.md.

Other prompt sets can join a run: `--distil-only` distils them into a data file that another run
adds with `--extra-data`. The held-out prompts' greedy answers are distilled too
(OUT/held-out.pt), so every epoch also records the head's top-1 agreement on them.

Distillation and training run on `device` (a CUDA GPU when there is one): the same code, with each
step's tensors moved there. On a GPU the tau measurement can wait (`eval_tokens` 0) for
`evaluate_only`, which decodes the run's held-out prompts on the CPU where the head will be used.

Stages are resumable: the distilled data (DATA, by default OUT/distilled.pt, saved every
SAVE_EVERY_S and after the last batch) and a checkpoint (weights, optimiser, epoch) are picked up by
a rerun with the same arguments. Output: config.json + model.safetensors + README.md + training.json
(whose "run" record lets `evaluate_only` rebuild the card).

Only the standard library is imported at module level, so that `speclens --help` stays fast.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

KINDS = ("eagle", "medusa", "datastore")
SAVE_EVERY_S = 300.0  # distilled data is saved at most this often (and after the last batch)


@dataclass(frozen=True)
class TrainOptions:
    kind: str
    target: str
    prompts: tuple[str, ...]
    out: str
    data: str = ""  # distilled data file, shareable between EAGLE and Medusa runs; "" = OUT/distilled.pt
    extra_data: tuple[str, ...] = ()  # distilled files of other prompt sets (made with distil_only), trained on too
    # folders of committed token-id shards (engine.distilled): the run's own answers are written into
    # the first, and every shard of every folder is trained on (features recomputed by prefill)
    shards: tuple[str, ...] = ()
    distil_only: bool = False  # stop after distilling (to build an extra_data file)
    self_prompts: int = 0  # extra training prompts written by the target itself (Magpie), kept in OUT
    self_prompt_temperature: float = 1.0
    distil_dtype: str = "float32"  # the target copy that writes prompts and answers and gives the features
    max_prompts: int = 100_000
    held_out: int = 20  # prompts kept for the tau evaluation
    answer_tokens: int = 160  # length of the target's distilled answers
    sampled_answers: int = 0  # extra answers per prompt, sampled at sample_temperatures in turn
    sample_temperatures: tuple[float, ...] = (0.7,)  # answer v (1..sampled_answers) at [(v - 1) % len]
    batch_size: int = 32  # prompts per distillation batch
    epochs: int = 10
    lr: float = 6e-4  # peak; linear warm-up over 5% of the steps, then cosine decay to 10%
    tokens_per_step: int = 2048  # packed tokens per optimiser step
    feature_noise: float = 0.1  # EAGLE: uniform noise on input features, in units of their RMS
    ce_weight: float = 0.1  # EAGLE: weight of the cross-entropy term (the feature regression has weight 1)
    # EAGLE: drafting passes per training step (2+: later passes read the head's own features; a step
    # then costs about D(D+1)/2 times as much, with attention over D x tokens_per_step entries)
    unroll: int = 1
    init_from_target: bool = False  # EAGLE: the decoder layer starts as a copy of the target's last layer
    init_from: str = ""  # a trained head folder of this kind to start from (to continue on more data)
    # EAGLE, and Medusa heads sharing the target's LM head: draft only the N most frequent answer tokens (0: all)
    draft_vocab: int = 8192
    medusa_heads: int = 4
    medusa_layers: int = 1
    medusa_tree_nodes: int = 24  # Medusa: nodes of the sparse tree built from the heads' measured accuracy
    depth: int = 6  # EAGLE dynamic tree depth for the evaluation (Medusa: its number of heads)
    top_k: int = 8  # EAGLE dynamic tree: children per expanded node and nodes expanded per depth
    budget: int = 32  # EAGLE dynamic tree: nodes verified per step
    chain: int = 4  # EAGLE chain length for the evaluation
    eval_tokens: int = 128  # new tokens per held-out prompt when measuring tau (0: measure later, see evaluate_only)
    threads: int = 2
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"  # where distillation and training run (auto: a CUDA GPU if there is one, else the CPU)
    evaluate_only: bool = False  # measure tau of the head already in OUT and rewrite its card (no training)

    @property
    def data_path(self) -> Path:
        return Path(self.data) if self.data else Path(self.out) / "distilled.pt"


def load_prompts(paths: tuple[str, ...]) -> list[str]:
    """Self-Instruct style .jsonl (instruction + the first instance's input) or one prompt a line, without duplicates."""
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
    return list(dict.fromkeys(prompts))  # a prompt listed twice (say, by two generator seeds) counts once


def split_prompts(prompts: list[str], options: TrainOptions) -> tuple[list[str], list[str]]:
    order = list(range(len(prompts)))
    random.Random(options.seed).shuffle(order)
    chosen = [prompts[i] for i in order[: options.max_prompts + options.held_out]]
    return chosen[options.held_out :], chosen[: options.held_out]


# --- 0. prompts written by the target ---------------------------------------------------------


def user_turn_prefix(tokenizer) -> list[int]:
    """The chat template's token ids up to where a user's first message begins (system turn and
    all): what an instruct model sees just before a user writes."""
    marker = "\u2063speclens\u2063"  # text no template adds of its own
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


def write_self_prompts(model, tokenizer, n: int, end_ids: tuple[int, ...], path: Path, temperature: float = 1.0,
                       batch_size: int = 128, max_tokens: int = 80, seed: int = 0) -> list[str]:
    """n distinct user prompts written by the target (Magpie, Xu et al. 2024): given the chat
    template up to a user turn, an instruct model writes a user message of the kind it was tuned
    on, so the prompts follow its own training distribution rather than a template of ours. Turns
    that do not end within max_tokens, that are under 16 characters, or that repeat are dropped.
    Appended to `path` (JSON lines) batch by batch; a rerun continues from what is there."""
    import torch
    from tqdm import tqdm
    from transformers import DynamicCache

    path.parent.mkdir(parents=True, exist_ok=True)
    prompts = [json.loads(line)["prompt"] for line in path.read_text(encoding="utf-8").splitlines()] if path.exists() else []
    seen = set(prompts)
    prefix = torch.tensor([user_turn_prefix(tokenizer)], device=model.device)  # [1, P]
    ends = torch.tensor(end_ids, device=model.device)
    generator = torch.Generator(device=model.device).manual_seed(seed * 100_003 + len(prompts))
    bar = tqdm(total=n, initial=min(len(prompts), n), desc="self-prompts (the target writes user turns)")
    fruitless = 0  # batches in a row that added no prompt
    while len(prompts) < n:
        alive = torch.arange(batch_size, device=model.device)  # [B] rows still writing
        written = torch.zeros(batch_size, max_tokens, dtype=torch.long, device=model.device)  # [B, max_tokens]
        lengths = torch.full((batch_size,), -1, device=model.device)  # [B]: -1 = not finished
        cache = DynamicCache()
        fed = prefix.expand(batch_size, -1)  # [B, P]: every row starts from the same prefix
        with torch.inference_mode():
            for step in range(max_tokens):
                logits = model(input_ids=fed, cache=cache, use_cache=True).logits[:, -1].float()  # [b, V]
                token = sample_rows((logits / temperature).softmax(-1), generator)  # [b]
                written[alive, step] = token
                done = torch.isin(token, ends)
                lengths[alive[done]] = step
                if done.all():
                    break
                if done.any():  # finished rows leave the batch
                    keep = (~done).nonzero()[:, 0]
                    cache.batch_select_indices(keep)
                    alive, token = alive[keep], token[keep]
                fed = token[:, None]
        new = []
        for row in range(batch_size):
            if lengths[row] < 0:
                continue
            text = tokenizer.decode(written[row, : lengths[row]], skip_special_tokens=True).strip()
            if len(text) >= 16 and text not in seen and len(prompts) + len(new) < n:
                seen.add(text)
                new.append(text)
        with path.open("a", encoding="utf-8") as f:  # once per batch
            f.writelines(json.dumps({"prompt": text}, ensure_ascii=False) + "\n" for text in new)
        prompts += new
        bar.update(len(new))
        fruitless = 0 if new else fruitless + 1
        if fruitless == 3:
            raise RuntimeError(f"the target wrote no new usable prompt in 3 batches of {batch_size} ({len(prompts)} of "
                               f"{n} so far, in {path}): try a higher --self-prompt-temperature or fewer --self-prompts")
    bar.close()
    return prompts[:n]


def sample_rows(p: torch.Tensor, generator) -> torch.Tensor:
    """One token per row of probabilities p [B, V] -> [B], by inverse-CDF sampling: one uniform per
    row, where torch.multinomial draws an exponential per vocabulary entry (most of a step's time at
    B = 256 and V = 49152 on CPU)."""
    import torch

    u = torch.rand(p.shape[0], 1, generator=generator, device=p.device)  # [B, 1]
    return torch.searchsorted(p.cumsum(-1), u)[:, 0].clamp(max=p.shape[-1] - 1)


# --- 1. distillation --------------------------------------------------------------------------


def distil(model, prompt_ids: list[list[int]], eos_ids: tuple[int, ...], options: TrainOptions) -> list[dict]:
    """[{"prompt", "variant", "tokens" [T] long, "features" [T, H] bf16, "answer_start"}], one per
    (prompt, variant); variant 0 is the greedy answer, 1.. are sampled ones. Resumable per batch."""
    import torch
    from tqdm import tqdm

    path = options.data_path
    done: list[dict] = torch.load(path, weights_only=True) if path.exists() else []
    have = {(int(s["prompt"]), int(s["variant"])) for s in done}
    batches = []  # (variant, [(prompt length, prompt index)]): one decoding mode per batch
    for variant in range(1 + options.sampled_answers):
        todo = sorted((len(ids), i) for i, ids in enumerate(prompt_ids) if (i, variant) not in have)  # little padding
        batches += [(variant, todo[s : s + options.batch_size]) for s in range(0, len(todo), options.batch_size)]
    bar = tqdm(batches, desc="distil (target answers + features)")
    saved = time.perf_counter()
    for n, (variant, batch) in enumerate(bar, start=1):
        start = time.perf_counter()
        temperature = variant_temperature(options, variant) or None  # None: greedy
        rows = _distil_batch(model, [prompt_ids[i] for _, i in batch], eos_ids, options, temperature)
        for (_, i), row in zip(batch, rows):
            done.append({"prompt": torch.tensor(i), "variant": torch.tensor(variant), **row})
        # The whole file is rewritten each time, so on a fast GPU saving after every batch would
        # cost more than distilling; a killed run loses at most SAVE_EVERY_S of work.
        if n == len(batches) or time.perf_counter() - saved > SAVE_EVERY_S:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(done, path)
            saved = time.perf_counter()
        new = sum(int(r["tokens"].shape[0] - r["answer_start"]) for r in rows)
        bar.set_postfix(answer_tok_per_s=f"{new / (time.perf_counter() - start):.0f}")
    return done


def _distil_batch(model, prompts: list[list[int]], eos_ids: tuple[int, ...], options: TrainOptions,
                  temperature: float | None) -> list[dict]:
    """The target's answers to `prompts`: greedy, or sampled at `temperature`."""
    import torch

    pad = eos_ids[0]
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, W], left padded
    attention = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, W]
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention[row, width - len(ids) :] = 1
    decoding = {"do_sample": False} if temperature is None else {
        "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
            max_new_tokens=options.answer_tokens, pad_token_id=pad, eos_token_id=list(eos_ids), **decoding,
        )
    sequences = []
    for row, ids in enumerate(prompts):
        answer = out[row, width:].tolist()
        end = next((j + 1 for j, token in enumerate(answer) if token in eos_ids), len(answer))
        sequences.append(ids + answer[:end])
    return _features(model, [tokens[:-1] for tokens in sequences], [len(ids) for ids in prompts], pad)


def _features(model, sequences: list[list[int]], answer_starts: list[int], pad: int) -> list[dict]:
    """The target's final hidden state at every position of each sequence, from one teacher-forced
    forward over the batch: {"tokens" [T], "features" [T, H] bf16, "answer_start"} per sequence."""
    import torch

    # Right padded, so positions need no shifting: much cheaper than collecting every layer's hidden
    # states during generate. The newest token of a sequence is never fed while decoding, so the
    # caller leaves it out.
    length = max(map(len, sequences))
    fed = torch.full((len(sequences), length), pad, dtype=torch.long)  # [B, L]
    fed_mask = torch.zeros(len(sequences), length, dtype=torch.long)  # [B, L]
    for row, tokens in enumerate(sequences):
        fed[row, : len(tokens)] = torch.tensor(tokens)
        fed_mask[row, : len(tokens)] = 1
    with torch.no_grad():  # not inference_mode: training reads these tensors
        # The decoder alone: its last hidden state is what CachedModel keeps, and the [B, L, V] logits
        # of the whole model would take gigabytes at large batches.
        hidden = model.get_decoder()(input_ids=fed.to(model.device),
                                     attention_mask=fed_mask.to(model.device)).last_hidden_state  # [B, L, H]
    return [{"tokens": torch.tensor(tokens),
             "features": hidden[row, : len(tokens)].to(torch.bfloat16).cpu(),
             "answer_start": torch.tensor(start)}
            for row, (tokens, start) in enumerate(zip(sequences, answer_starts))]


def shard_samples(model, sequences, pad: int, batch_size: int, first_prompt: int) -> list[dict]:
    """Training samples (features recomputed by batched prefill) of distilled shards' sequences."""
    import torch
    from tqdm import tqdm

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].tokens))  # little padding
    samples: list[dict] = [{}] * len(sequences)
    for s in tqdm(range(0, len(order), batch_size), desc="features of the committed shards"):
        batch = order[s : s + batch_size]
        rows = _features(model, [list(sequences[i].tokens) for i in batch],
                         [sequences[i].answer_start for i in batch], pad)
        for i, row in zip(batch, rows):
            samples[i] = {"prompt": torch.tensor(first_prompt + i),
                          "variant": torch.tensor(0 if sequences[i].temperature == 0 else 1), **row}
    return samples


def variant_temperature(options: TrainOptions, variant: int) -> float:
    """The temperature answer `variant` is sampled at: 0.0 for the greedy variant 0."""
    return options.sample_temperatures[(variant - 1) % len(options.sample_temperatures)] if variant else 0.0


def shard_run(options: TrainOptions, target_name: str) -> str:
    """The name of this run's shards: the settings that decide what it distils."""
    from speclens.engine.tools.distilled import run_id

    facts = {k: v for k, v in _neutral(options).items() if k in (
        "prompts", "self_prompts", "self_prompt_temperature", "answer_tokens", "sampled_answers",
        "sample_temperatures", "max_prompts", "held_out", "seed", "distil_dtype")}
    return run_id({**facts, "target": target_name})


def save_shards(samples: list[dict], options: TrainOptions, target_name: str, run: str) -> list[Path]:
    """The run's distilled answers as committed-size token-id shards in options.shards[0]."""
    from speclens.engine.tools.distilled import DistilledSequence, write_shards

    rows = sorted(samples, key=lambda s: (int(s["prompt"]), int(s["variant"])))
    sequences = [DistilledSequence(tuple(s["tokens"].tolist()), int(s["answer_start"]),
                                   variant_temperature(options, int(s["variant"]))) for s in rows]
    meta = {"target": target_name, "command": _command(options), "answer_tokens": str(options.answer_tokens),
            "distil_dtype": options.distil_dtype}
    return write_shards(options.shards[0], sequences, run, meta)


# --- 2. training ------------------------------------------------------------------------------


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


def _packed(step: list[dict], device=None):
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
    positions, mask, answer = _packed(step, device)
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


def train(head, samples: list[dict], options: TrainOptions, model, checkpoint: Path,
          held_out: list[dict] = ()) -> list[dict]:
    """Train the head; per epoch it records the mean training loss and top-1 agreement and, given
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

    def step_loss(step: list[dict], generator, unroll: int = options.unroll) -> tuple[torch.Tensor, float]:
        """The kind's loss and top-1 agreement; EAGLE's input features get noise from generator (None: none)."""
        with torch.autocast(device.type, dtype=torch.bfloat16):
            if options.kind == "eagle":
                noise = options.feature_noise if generator is not None else 0.0
                return eagle_loss(head, step, embed, lm_head, noise, generator, options.ce_weight, unroll)
            return medusa_loss(head, step, lm_head, label_index)

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


def load_head(kind: str, folder: str | Path, model):
    """A trained head of `kind` from `folder`, for the target `model` (float32)."""
    if kind == "eagle":
        from speclens.engine.drafters.eagle import EagleHead

        return EagleHead.load(folder).float()
    from speclens.engine.drafters.medusa import MedusaHeads

    config = model.config.get_text_config()
    return MedusaHeads.load(folder, config.hidden_size, config.vocab_size)


def new_head(kind: str, model, options: TrainOptions):
    config = model.config.get_text_config()
    if kind == "eagle":
        from speclens.engine.drafters.eagle import EagleHead

        if options.init_from:
            head = load_head(kind, options.init_from, model)
            if head.config.hidden_size != config.hidden_size:
                raise ValueError(f"{options.init_from}: an EAGLE head of width {head.config.hidden_size}, "
                                 f"the target has {config.hidden_size}")
            head.draft_vocab = None  # chosen again from this run's data
            return head.train()
        head = EagleHead.for_target(model.config).float()
        if options.init_from_target:
            head.layer.load_state_dict(model.model.layers[-1].state_dict())
        return head
    from speclens.engine.drafters.medusa import MedusaHeads

    if options.init_from:
        heads = load_head(kind, options.init_from, model)
        layers = heads.config.get("medusa_num_layers", 1)
        if len(heads) != options.medusa_heads or layers != options.medusa_layers:
            raise ValueError(f"{options.init_from}: {len(heads)} Medusa heads of {layers} layer(s), not the "
                             f"{options.medusa_heads} of {options.medusa_layers} asked for")
        heads.draft_vocab = None  # chosen again from this run's data
        return heads.train()
    return MedusaHeads(config.hidden_size, config.vocab_size, num_heads=options.medusa_heads,
                       num_layers=options.medusa_layers, shared_lm_head=True)


# --- 3. evaluation ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalSetup:
    description: str
    depth: int  # K of a chain drafter, the tree depth of a tree drafter
    make_drafter: Callable  # CachedModel of the target -> the drafter (heads read that model's features)


def decoding_setups(kind: str, head, options: TrainOptions) -> dict[str, EvalSetup]:
    """The decoding setups a head is evaluated with."""
    from speclens.engine.decoding.tree import CHAIN_PATHS, DEFAULT_TREE_PATHS, TreeShape

    def setup(description: str, shape, depth: int) -> EvalSetup:
        return EvalSetup(description, depth, functools.partial(drafter_for, kind, head, shape=shape, options=options))

    if kind == "eagle":
        chain = TreeShape.from_paths(CHAIN_PATHS).truncated(options.chain)
        return {
            "chain": setup(f"EAGLE chain, K={options.chain}", chain, options.chain),
            "tree": setup(f"dynamic EAGLE-2-style tree, depth {options.depth}, top-k {options.top_k}, "
                          f"budget {options.budget} nodes", None, options.depth),
        }
    shape = TreeShape.from_paths(DEFAULT_TREE_PATHS).truncated(options.medusa_heads)
    setups = {"tree": setup(f"static Medusa tree (speclens DEFAULT_TREE_PATHS, {len(shape.parents)} nodes, "
                            f"depth {shape.depth})", shape, shape.depth)}
    if head.config.get("medusa_choices"):
        sparse = TreeShape.from_paths(head.config["medusa_choices"])
        setups["sparse"] = setup(f"static Medusa sparse tree of config.json medusa_choices "
                                 f"({len(sparse.parents)} nodes, depth {sparse.depth})", sparse, sparse.depth)
    return setups


def drafter_for(kind: str, head, target, shape, options: TrainOptions):
    if kind == "eagle":
        from speclens.engine.drafters.eagle import EagleDrafter

        return EagleDrafter(head, target, shape, top_k=options.top_k, budget=options.budget)
    from speclens.engine.drafters.medusa import MedusaDrafter

    return MedusaDrafter(head, target, shape)


def evaluate_tau(model, tokenizer, prompt_ids: list[list[int]], eos_ids: tuple[int, ...], head,
                 options: TrainOptions) -> dict[str, dict]:
    """Greedy decoding on held-out prompts per decoding setup of the head (see evaluate_drafters)."""
    return evaluate_drafters(model, tokenizer, prompt_ids, eos_ids, decoding_setups(options.kind, head, options),
                             options.eval_tokens)


def evaluate_drafters(model, tokenizer, prompt_ids: list[list[int]], eos_ids: tuple[int, ...],
                      setups: dict[str, EvalSetup], eval_tokens: int) -> dict[str, dict]:
    """Greedy decoding on held-out prompts per setup: tau = emitted tokens / target passes, with the
    mean draft and verify time per step."""
    from tqdm import tqdm

    from speclens.engine.decoding.decode import GenerationConfig, generate
    from speclens.engine.decoding.events import StepEvent, Summary
    from speclens.engine.runtime.cache import CachedModel

    results = {}
    for name, setup in setups.items():
        target = CachedModel(model, len(tokenizer))
        drafter = setup.make_drafter(target)
        config = GenerationConfig(method=name, k=setup.depth, max_new_tokens=eval_tokens)
        new = steps = 0
        draft_s = verify_s = 0.0
        start = time.perf_counter()
        for ids in tqdm(prompt_ids, desc=f"evaluate tau, {name} (held-out)"):
            for event in generate(target, tokenizer, ids, config, drafter, eos_ids):
                if isinstance(event, StepEvent):
                    draft_s += event.draft_s
                    verify_s += event.verify_s
                elif isinstance(event, Summary):
                    new += event.new_tokens
                    steps += event.steps
        results[name] = {"description": setup.description, "tau": new / max(steps, 1), "tokens": new,
                         "target_passes": steps, "prompts": len(prompt_ids),
                         "draft_ms_per_step": 1000 * draft_s / max(steps, 1),
                         "verify_ms_per_step": 1000 * verify_s / max(steps, 1),
                         "seconds": time.perf_counter() - start}
    return results


def _sampled_phrase(options: TrainOptions) -> str:
    temperatures = options.sample_temperatures[: options.sampled_answers]
    return (f" plus {options.sampled_answers} answer(s) sampled at temperature "
            f"{', '.join(f'{t:g}' for t in temperatures)}{' in turn' if len(temperatures) > 1 else ''}"
            if options.sampled_answers else "")


def _tau_row(r: dict) -> str:
    return (f"| **tau on held-out prompts, {r['description']}** | **{r['tau']:.3f}** ({r['tokens']} tokens in "
            f"{r['target_passes']} target passes over {r['prompts']} prompts; draft {r['draft_ms_per_step']:.1f} ms, "
            f"verify {r['verify_ms_per_step']:.1f} ms per step) |")


def write_card(out: Path, options: TrainOptions, n_train: int, n_held: int, n_samples: tuple[int, int], n_tokens: int,
               n_steps: int, history: list[dict], tau: dict[str, dict], target_name: str, command: str,
               draft_vocab_coverage: float | None = None, device: str = "cpu", eval_device: str = "cpu") -> None:
    last = history[-1] if history else {}
    kind = "EAGLE-1" if options.kind == "eagle" else "Medusa-1"
    rows = "\n".join(_tau_row(r) for r in tau.values()) or (
        "| tau on held-out prompts | not measured yet (`--eval-tokens 0`): rerun the command with "
        "`--evaluate-only` to measure it on this machine's CPU |")
    where = "CPU (float32)" if eval_device == "cpu" else f"{eval_device} (the target as the app loads it there)"
    sampled = _sampled_phrase(options)
    architecture = ("one Llama decoder layer over fc([embed(token); feature]); "
                    + (f"continued from {Path(options.init_from).name}" if options.init_from else
                       "layer initialised from the target's last layer" if options.init_from_target else
                       "random initialisation")
                    + (f"; training-time test over {options.unroll} drafting passes (passes 2+ read the "
                       "head's own predicted features)" if options.unroll > 1 else "")
                    if options.kind == "eagle" else
                    f"{options.medusa_heads} heads of {options.medusa_layers} residual block(s), sharing the "
                    "target's LM head" + (f"; continued from {Path(options.init_from).name}" if options.init_from else ""))
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
                f"{', mean over heads' if options.kind == 'medusa' else ''}) | {held_top1:.3f} |\n"
                if held_top1 is not None else "")
    text = f"""# {kind} draft head for {target_name}

Trained by `speclens train-drafter` (self-distillation): the target answered {n_train} training
prompts with the chat template, greedily{sampled} (up to {options.answer_tokens} new tokens each),
and the head learned from the target's own final hidden states and next-token distributions.
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

Files: `config.json`, `model.safetensors` (head weights only; the target's embedding and LM head are
reused), `training.json` (per-epoch loss and the evaluation). Options (paths shortened to their
last part): `{json.dumps(_neutral(options))}`.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


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
                          engine.target.name, _command(options))
    result = {"tau": tau, "history": []}
    (out / "training.json").write_text(json.dumps(result, indent=2))
    return result


def _write_datastore_card(out: Path, options: TrainOptions, store, n_train: int, n_held: int,
                          n_samples: tuple[int, int], tau: dict[str, dict], target_name: str, command: str) -> None:
    rows = "\n".join(_tau_row(r) for r in tau.values())
    prompt_files = ", ".join(Path(p).name for p in options.prompts)
    extra = (f" Also {n_samples[1]} answers distilled the same way from other prompts: "
             + ", ".join(Path(p).name for p in options.extra_data) + "." if options.extra_data else "")
    written = (f", and {options.self_prompts} user prompts the target wrote itself (self-prompts.jsonl, as in Magpie)"
               if options.self_prompts else "")
    sampled = _sampled_phrase(options)
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
Options (paths shortened to their last part): `{json.dumps(_neutral(options))}`.
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def _neutral(options: TrainOptions) -> dict:
    """The options with every path cut to its last part (a card must not name this machine's folders)."""
    values = asdict(options)
    values["prompts"] = [Path(p).name for p in options.prompts]
    values["out"] = Path(options.out).name
    values["data"] = Path(options.data).name if options.data else ""
    values["extra_data"] = [Path(p).name for p in options.extra_data]
    values["shards"] = [Path(p).name for p in options.shards]
    values["init_from"] = Path(options.init_from).name if options.init_from else ""
    return values


def run(options: TrainOptions) -> dict:
    import torch

    from speclens.engine.runtime.models import LoadOptions, load_model, resolve_device
    from speclens.engine.session import Engine

    if options.unroll < 1 or (options.unroll > 1 and options.kind != "eagle"):
        raise ValueError(f"--unroll {options.unroll}: give 1, or 2+ drafting passes for an EAGLE head")
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
    samples = distil(teacher, encode, engine.eos_ids, options)
    run_name = shard_run(options, engine.target.name)
    written = save_shards(samples, options, engine.target.name, run_name) if options.shards else []
    if options.distil_only:
        return {"distilled": len(samples), "data": str(options.data_path), "shards": [str(p) for p in written]}
    own = len(samples)
    for path in options.extra_data:
        samples = samples + torch.load(path, weights_only=True)
    if options.shards:
        from speclens.engine.tools.distilled import read_all

        sequences, _ = read_all(options.shards, target=engine.target.name, skip_run=run_name)
        samples = samples + shard_samples(teacher, sequences, engine.eos_ids[0], options.batch_size, len(samples))
    if options.kind == "datastore":
        return build_datastore(options, samples, engine, held_ids, (len(train_prompts), len(held_out), own))
    held_samples = distil(teacher, held_ids, engine.eos_ids,
                          replace(options, data=str(out / "held-out.pt"), sampled_answers=0))  # greedy only
    head = new_head(options.kind, model, options)
    history = train(head, samples, options, model, out / "checkpoint.pt", held_samples)
    if options.kind == "medusa":
        from speclens.engine.drafters.medusa import sparse_tree_paths

        accuracy = medusa_rank_accuracy(head, samples[:: max(len(samples) // 40, 1)], model.get_output_embeddings())
        head.config["medusa_rank_accuracy"] = [[round(a, 4) for a in row] for row in accuracy]
        head.config["medusa_choices"] = [list(p) for p in sparse_tree_paths(accuracy, options.medusa_tree_nodes)]
    coverage = None
    if options.draft_vocab and (options.kind == "eagle" or head.shared_lm_head):
        head.draft_vocab, coverage = draft_vocabulary(samples, options.draft_vocab)
        if options.kind == "eagle":
            head.config.speclens_draft_vocab_coverage = round(coverage, 5)
        else:
            head.config["speclens_draft_vocab_coverage"] = round(coverage, 5)
    if head.draft_vocab is not None:
        head.draft_vocab = head.draft_vocab.to(model.device)  # the evaluation drafts on the target's device
    head.save(out)
    run_facts = {"n_train": len(train_prompts), "n_held": len(held_out), "n_samples": [own, len(samples) - own],
                 "n_tokens": sum(int(s["tokens"].shape[0]) for s in samples),
                 "n_steps": options.epochs * len(pack(samples, list(range(len(samples))), options.tokens_per_step)),
                 "draft_vocab_coverage": coverage, "device": device, "command": _command(options),
                 "options": _neutral(options)}
    tau = evaluate_tau(model, tokenizer, held_ids, engine.eos_ids, head, options) if options.eval_tokens else {}
    return _record(out, options, run_facts, history, tau, engine.target.name, device)


def _record(out: Path, options: TrainOptions, run_facts: dict, history: list[dict], tau: dict[str, dict],
            target_name: str, eval_device: str) -> dict:
    """Write the model card and training.json of a trained head."""
    write_card(out, options, run_facts["n_train"], run_facts["n_held"], tuple(run_facts["n_samples"]),
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
    head = load_head(options.kind, out, engine.target.model).eval()
    tau = evaluate_tau(engine.target.model, engine.target.tokenizer, held_ids, engine.eos_ids, head, trained)
    return _record(out, trained, record["run"], record["history"], tau, engine.target.name, "cpu")


def _command(options: TrainOptions) -> str:
    """The `speclens train-drafter` command line of these options, with neutral paths."""
    defaults = asdict(TrainOptions(options.kind, options.target, (), ""))
    values = _neutral(options)
    words = ["speclens train-drafter", f"--kind {options.kind}"]
    words += [f"--prompts data/self-instruct/{name}" for name in values["prompts"]]
    words += [f"--out {values['out']}"] + ([f"--data {values['data']}"] if options.data else [])
    words += [f"--extra-data {name}" for name in values["extra_data"]]
    words += [f"--shards data/distilled/{name}" for name in values["shards"]]
    for name, value in values.items():
        if name in ("kind", "prompts", "out", "data", "extra_data", "shards", "dtype", "evaluate_only") or value == defaults[name]:
            continue
        if name in ("init_from_target", "distil_only"):
            words.append(f"--{name.replace('_', '-')}")
        elif name == "sample_temperatures":
            words.append(f"--sample-temperatures {','.join(f'{t:g}' for t in value)}")
        else:
            words.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(words)


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(t > 0 for t in values):
        raise argparse.ArgumentTypeError(f"give positive temperatures separated by commas, got {text!r}")
    return values


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--prompts", action="append", required=True, help="a .jsonl or text file (repeatable)")
    parser.add_argument("--out", required=True, help="output folder (also holds resumable state)")
    parser.add_argument("--data", default="", help="distilled data file (default OUT/distilled.pt); "
                        "an EAGLE and a Medusa run with the same prompts can share it")
    defaults = TrainOptions("eagle", "", (), "")
    for name in ("max_prompts", "held_out", "answer_tokens", "sampled_answers", "batch_size", "epochs",
                 "tokens_per_step", "unroll", "draft_vocab", "medusa_heads", "medusa_layers", "medusa_tree_nodes", "depth", "top_k", "budget", "chain",
                 "eval_tokens", "threads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--self-prompts", type=int, default=defaults.self_prompts, metavar="N",
                        help="also train on N user prompts the target writes itself (Magpie), kept in OUT/self-prompts.jsonl")
    parser.add_argument("--self-prompt-temperature", type=float, default=defaults.self_prompt_temperature)
    parser.add_argument("--sample-temperatures", type=_temperatures, default=defaults.sample_temperatures,
                        metavar="T[,T...]", help="temperatures of the --sampled-answers, in turn "
                        f"(default {','.join(f'{t:g}' for t in defaults.sample_temperatures)})")
    parser.add_argument("--distil-dtype", choices=("float32", "bfloat16"), default=defaults.distil_dtype,
                        help="dtype of the target copy that writes the prompts and answers and gives the features")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--feature-noise", type=float, default=defaults.feature_noise)
    parser.add_argument("--ce-weight", type=float, default=defaults.ce_weight,
                        help="EAGLE: weight of the cross-entropy to the target's next-token distribution")
    parser.add_argument("--extra-data", action="append", default=[],
                        help="a distilled data file of other prompts (from a --distil-only run) to train on too (repeatable)")
    parser.add_argument("--shards", action="append", default=[], metavar="DIR",
                        help="folder of committed token-id shards (repeatable): this run's answers are written "
                             "into the first, and every shard found is trained on")
    parser.add_argument("--distil-only", action="store_true",
                        help="stop after distilling the prompts into DATA (for --extra-data of another run)")
    parser.add_argument("--init-from", default="", metavar="DIR",
                        help="start from a trained head of the same kind (continue training it on more data)")
    parser.add_argument("--init-from-target", action="store_true",
                        help="EAGLE: start the decoder layer as a copy of the target's last layer")
    parser.add_argument("--device", default=defaults.device,
                        help="where to distil and train: auto (a CUDA GPU if there is one), cpu, cuda or cuda:N")
    parser.add_argument("--evaluate-only", action="store_true",
                        help="measure tau of the head a finished run left in OUT (e.g. trained on a GPU with "
                        "--eval-tokens 0) on this machine's CPU, on that run's held-out prompts, and rewrite its "
                        "card; give the run's --kind, --prompts and --out (its other options come from training.json)")


def cmd_train_drafter(args: argparse.Namespace) -> int:
    names = [f for f in TrainOptions.__dataclass_fields__
             if f not in ("kind", "target", "prompts", "out", "extra_data", "shards")]
    options = TrainOptions(kind=args.kind, target=args.target, prompts=tuple(args.prompts), out=args.out,
                           extra_data=tuple(args.extra_data), shards=tuple(args.shards), **{name: getattr(args, name) for name in names if name != "dtype"})
    result = run(options)
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
