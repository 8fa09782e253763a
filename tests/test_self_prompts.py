"""Training prompts written by the target itself (Magpie): the user-turn prefix, the sampler, resuming."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from speclens.engine.tools.train.distil import sample_rows, user_turn_prefix, write_self_prompts
from tests.tiny import tiny_llama, tiny_tokenizer


def test_user_turn_prefix_is_the_template_up_to_the_user_message():
    tokenizer = tiny_tokenizer()
    prefix = user_turn_prefix(tokenizer)
    assert tokenizer.decode(prefix) == "<|im_start|>user\n"
    full = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert tokenizer(full, add_special_tokens=False)["input_ids"][: len(prefix)] == prefix


def test_sample_rows_draws_from_the_given_distribution():
    p = torch.tensor([0.02, 0.3, 0.0, 0.08, 0.25, 0.05, 0.2, 0.1])
    trials = 65_536
    tokens = sample_rows(p.expand(trials, -1), torch.Generator().manual_seed(0))  # [trials]
    counts = torch.bincount(tokens, minlength=len(p)).double()
    expected = trials * p.double()
    sigma = (trials * p.double() * (1 - p.double())).sqrt()
    assert counts[2] == 0  # a token of probability 0 is never drawn
    assert torch.all((counts - expected).abs() <= 6 * sigma + 5), (counts, expected)
    # the check can fail: a sampler off by one token (the CDF searched on the wrong side) is caught
    shifted = (tokens + 1) % len(p)
    wrong = torch.bincount(shifted, minlength=len(p)).double()
    assert not torch.all((wrong - expected).abs() <= 6 * sigma + 5)


class _EndsEarly(nn.Module):
    """A tiny Llama whose end-of-turn logit is raised, so sampled user turns end within a few tokens."""

    def __init__(self, model, end_id: int, boost: float):
        super().__init__()
        self.model, self.end_id, self.boost = model, end_id, boost

    @property
    def device(self):
        return self.model.device

    def forward(self, **kwargs):
        out = self.model(**kwargs)
        out.logits[..., self.end_id] += self.boost
        return out


@pytest.fixture()
def writer():
    tokenizer = tiny_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return _EndsEarly(tiny_llama(seed=3), end, boost=4.0), tokenizer, (end,)


def test_self_prompts_are_distinct_finished_turns_and_resume(tmp_path, writer):
    model, tokenizer, ends = writer
    path = tmp_path / "self-prompts.jsonl"
    first = write_self_prompts(model, tokenizer, 6, ends, path, batch_size=16, max_tokens=24, seed=1)
    assert len(first) == 6 and len(set(first)) == 6
    assert all(len(p) >= 16 and "<|im_end|>" not in p for p in first)
    assert [json.loads(line)["prompt"] for line in path.read_text().splitlines()] == first
    more = write_self_prompts(model, tokenizer, 10, ends, path, batch_size=16, max_tokens=24, seed=1)
    assert more[:6] == first and len(set(more)) == 10  # a rerun keeps what was written and adds to it
    again = tmp_path / "again.jsonl"
    assert write_self_prompts(model, tokenizer, 6, ends, again, batch_size=16, max_tokens=24, seed=1) == first  # seeded


def test_self_prompts_stop_with_a_clear_error_when_nothing_new_comes(tmp_path, writer):
    model, tokenizer, ends = writer
    model.boost = 1e4  # every turn ends at once: empty, so never usable
    with pytest.raises(RuntimeError, match="no new usable prompt"):
        write_self_prompts(model, tokenizer, 4, ends, tmp_path / "p.jsonl", batch_size=4, max_tokens=8)


def test_train_drafter_adds_self_prompts_distilled_by_a_bfloat16_copy(tmp_path):
    from speclens.engine.tools.cli import main

    model_dir = tmp_path / "tiny-target"
    tiny_llama(seed=3).save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"instruction": f"Count to {i}."}) for i in range(4)))
    out = tmp_path / "heads"
    args = ["train-drafter", "--kind", "eagle", "--target", str(model_dir), "--prompts", str(prompts),
            "--out", str(out), "--held-out", "1", "--answer-tokens", "4", "--batch-size", "64",
            "--self-prompts", "3", "--distil-dtype", "bfloat16"]
    assert main(args + ["--distil-only"]) == 0
    written = [json.loads(line)["prompt"] for line in (out / "self-prompts.jsonl").read_text().splitlines()]
    assert len(written) == 3
    distilled = torch.load(out / "distilled.pt", weights_only=True)
    assert sorted(int(s["prompt"]) for s in distilled) == list(range(3 + 3))  # 3 file prompts + 3 self-prompts
    tokenizer = tiny_tokenizer()
    for sample in distilled:
        text = tokenizer.decode(sample["tokens"][: int(sample["answer_start"])])
        assert text.count("<|im_start|>user") == 1
    asked = {tokenizer.decode(s["tokens"][: int(s["answer_start"])]) for s in distilled}
    assert all(any(prompt in text for text in asked) for prompt in written)
    # training on them: the card names the prompts the target wrote and the bfloat16 teacher
    assert main(args + ["--epochs", "1", "--eval-tokens", "4", "--depth", "2", "--budget", "4"]) == 0
    card = (out / "README.md").read_text()
    assert "3 user prompts the target wrote itself" in card and "bfloat16 copy of the target" in card
    assert "--self-prompts 3" in card and "--distil-dtype bfloat16" in card
