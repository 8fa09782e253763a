"""Stage 1, distillation: the target's own answers and final hidden states (features).

The target answers the training prompts (chat template) in left-padded batches, greedily and
optionally also sampled; one teacher-forced pass over each batch of prompt + answer then gives the
features at every position. Also: prompts the target writes itself (Magpie), and the samples of
committed token-id shards (shards.py), whose features are recomputed by batched prefill.

A sample is {"prompt", "variant", "tokens" [T] long, "features" [T, H] bf16, "answer_start"};
variant 0 is the greedy answer, 1.. are sampled ones.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from speclens.engine.tools.train.options import command_line, neutral

if TYPE_CHECKING:
    import torch

    from speclens.engine.tools.train.options import TrainOptions

SAVE_EVERY_S = 300.0  # distilled data is saved at most this often (and after the last batch)
IDS_SAVE_EVERY_S = 60.0  # token ids alone (and the shards made from them) are small: saved more often


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


def distil(model, prompt_ids: list[list[int]], eos_ids: tuple[int, ...], options: TrainOptions,
           on_save: Callable[[list[dict]], object] | None = None, features: bool = True,
           have_greedy: frozenset[tuple[int, ...]] = frozenset(), layers: tuple[int, ...] = ()) -> list[dict]:
    """[{"prompt", "variant", "tokens" [T] long, "features" [T, H] bf16, "answer_start"}], one per
    (prompt, variant); variant 0 is the greedy answer, 1.. are sampled ones. Resumable per batch.

    `on_save(done)` runs at every save (the token-id shards then grow with the run, so a run stopped at
    any moment keeps its answers). features=False keeps token ids alone (a data-gathering run: training
    recomputes features from the shards), in their own file beside the data file, saved every
    IDS_SAVE_EVERY_S. Prompts in `have_greedy` (other runs' shards hold their greedy answer) get no greedy
    answer again: every run adds new data. `layers` (HF hidden_states indices) adds "fused" [T, n H] bf16,
    those layers' states side by side (what an EAGLE-3 head reads)."""
    import torch
    from tqdm import tqdm

    path = options.data_path if features else options.data_path.with_name(options.data_path.stem + "-ids.pt")
    every = SAVE_EVERY_S if features else IDS_SAVE_EVERY_S
    done: list[dict] = torch.load(path, weights_only=True) if path.exists() else []
    have = {(int(s["prompt"]), int(s["variant"])) for s in done}
    batches = []  # (variant, [(prompt length, prompt index)]): one decoding mode per batch
    for variant in range(1 + options.sampled_answers):
        todo = sorted((len(ids), i) for i, ids in enumerate(prompt_ids)  # sorted by length: little padding
                      if (i, variant) not in have and not (variant == 0 and tuple(ids) in have_greedy))
        batches += [(variant, todo[s : s + options.batch_size]) for s in range(0, len(todo), options.batch_size)]
    bar = tqdm(batches, desc="distil (target answers + features)" if features else "distil (target answers)")
    saved = began = time.perf_counter()
    for n, (variant, batch) in enumerate(bar, start=1):
        if options.distil_seconds and time.perf_counter() - began > options.distil_seconds:
            break  # out of time: what is done was saved as the last batch ended, and a rerun resumes
        start = time.perf_counter()
        temperature = variant_temperature(options, variant) or None  # None: greedy
        rows = _distil_batch(model, [prompt_ids[i] for _, i in batch], eos_ids, options, temperature, features,
                             layers)
        for (_, i), row in zip(batch, rows):
            done.append({"prompt": torch.tensor(i), "variant": torch.tensor(variant), **row})
        # The whole file is rewritten each time, so on a fast GPU saving after every batch would
        # cost more than distilling; a killed run loses at most SAVE_EVERY_S of work.
        over = options.distil_seconds and time.perf_counter() - began > options.distil_seconds
        if n == len(batches) or over or time.perf_counter() - saved > every:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            torch.save(done, tmp)
            tmp.replace(path)  # a run killed while saving keeps the previous file whole
            if on_save is not None:
                on_save(done)
            saved = time.perf_counter()
        new = sum(int(r["tokens"].shape[0] - r["answer_start"]) for r in rows)
        bar.set_postfix(answer_tok_per_s=f"{new / (time.perf_counter() - start):.0f}")
    return done


def _distil_batch(model, prompts: list[list[int]], eos_ids: tuple[int, ...], options: TrainOptions,
                  temperature: float | None, features: bool = True, layers: tuple[int, ...] = ()) -> list[dict]:
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
    fed = [tokens[:-1] for tokens in sequences]  # the newest token is never fed (see _features)
    if not features:
        return [{"tokens": torch.tensor(tokens), "answer_start": torch.tensor(len(ids))}
                for tokens, ids in zip(fed, prompts)]
    return _features(model, fed, [len(ids) for ids in prompts], pad, layers)


def _features(model, sequences: list[list[int]], answer_starts: list[int], pad: int,
              layers: tuple[int, ...] = ()) -> list[dict]:
    """The target's final hidden state at every position of each sequence, from one teacher-forced
    forward over the batch: {"tokens" [T], "features" [T, H] bf16, "answer_start"} per sequence, and
    with `layers` "fused" [T, len(layers) H] bf16, those hidden states side by side."""
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
        out = model.get_decoder()(input_ids=fed.to(model.device), attention_mask=fed_mask.to(model.device),
                                  output_hidden_states=bool(layers))
        hidden = out.last_hidden_state  # [B, L, H]
        fused = torch.cat([out.hidden_states[j] for j in layers], dim=-1) if layers else None  # [B, L, n H]
    return [{"tokens": torch.tensor(tokens),
             "features": hidden[row, : len(tokens)].to(torch.bfloat16).cpu(),
             **({"fused": fused[row, : len(tokens)].to(torch.bfloat16).cpu()} if layers else {}),
             "answer_start": torch.tensor(start)}
            for row, (tokens, start) in enumerate(zip(sequences, answer_starts))]


def shard_samples(model, sequences, pad: int, batch_size: int, first_prompt: int,
                  layers: tuple[int, ...] = ()) -> list[dict]:
    """Training samples (features recomputed by batched prefill) of distilled shards' sequences."""
    import torch
    from tqdm import tqdm

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].tokens))  # little padding
    samples: list[dict] = [{}] * len(sequences)
    for s in tqdm(range(0, len(order), batch_size), desc="features of the committed shards"):
        batch = order[s : s + batch_size]
        rows = _features(model, [list(sequences[i].tokens) for i in batch],
                         [sequences[i].answer_start for i in batch], pad, layers)
        for i, row in zip(batch, rows):
            samples[i] = {"prompt": torch.tensor(first_prompt + i),
                          "variant": torch.tensor(0 if sequences[i].temperature == 0 else 1), **row}
    return samples


def variant_temperature(options: TrainOptions, variant: int) -> float:
    """The temperature answer `variant` is sampled at: 0.0 for the greedy variant 0."""
    return options.sample_temperatures[(variant - 1) % len(options.sample_temperatures)] if variant else 0.0


def shard_run(options: TrainOptions, target_name: str) -> str:
    """The name of this run's shards: the settings that decide what it distils."""
    from speclens.engine.tools.train.shards import run_id

    facts = {k: v for k, v in neutral(options).items() if k in (
        "prompts", "self_prompts", "self_prompt_temperature", "answer_tokens", "sampled_answers",
        "sample_temperatures", "max_prompts", "held_out", "seed", "distil_dtype")}
    return run_id({**facts, "target": target_name})


def save_shards(samples: list[dict], options: TrainOptions, target_name: str, run: str) -> list[Path]:
    """The run's distilled answers as committed-size token-id shards in options.shards[0]."""
    from speclens.engine.tools.train.shards import DistilledSequence, write_shards

    rows = sorted(samples, key=lambda s: (int(s["prompt"]), int(s["variant"])))
    sequences = [DistilledSequence(tuple(s["tokens"].tolist()), int(s["answer_start"]),
                                   variant_temperature(options, int(s["variant"]))) for s in rows]
    meta = {"target": target_name, "command": command_line(options), "answer_tokens": str(options.answer_tokens),
            "distil_dtype": options.distil_dtype}
    return write_shards(options.shards[0], sequences, run, meta)
