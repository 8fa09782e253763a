"""Tiny models and an offline tokenizer, built in-process: tests never touch a model hub."""

from __future__ import annotations

import functools

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speclens.engine.runtime.models import LoadedModel
from speclens.engine.session import Engine

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and verifies them with the target model.",
    "Café, naïve, 東京, emoji 🙂 and other multi-byte text.",
    "one two three four five six seven eight nine ten",
]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of about 400 tokens, trained in milliseconds."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(seed: int = 0, layers: int = 2, hidden: int = 64, vocab: int | None = None) -> LlamaForCausalLM:
    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=vocab or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Larger logits than the default init give peaked, model-like distributions.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model.eval()


def q4_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 [n, k] weight as a Q4_1 GGUF dequantises to: per 32 inputs m + d * q, d and m half
    precision, q = 0..15 with the block's extremes at 0 and 15 (as the quantiser sets d and m)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    return torch.addcmul(m, d, q).view(n, k)


def q8_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 [n, k] weight as a Q8_0 GGUF dequantises to: per 32 inputs d * q, d half precision,
    q = -127..127 with the block's largest magnitude at 127 (as the quantiser sets d = max |w| / 127)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.002 + 1e-4).half().float()
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
    q[..., 0] = 127 * torch.where(torch.rand(n, k // 32, generator=g) < 0.5, -1.0, 1.0)
    return (d * q).view(n, k)


def tiny_quantised_llama(seed: int = 0) -> LlamaForCausalLM:
    """tiny_llama with decoder weights as a Q4_1 GGUF dequantises to and an LM head as a Q8_0 one (the
    embedded default's formats), so the native kernels run it on 4-bit and 8-bit blocks."""
    model = tiny_llama(seed=seed)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for j, linear in enumerate([*layer.self_attn.children(), *layer.mlp.children()]):
                if isinstance(linear, torch.nn.Linear):
                    linear.weight.copy_(q4_weight(*linear.weight.shape, seed=10 * i + j))
        model.lm_head.weight.copy_(q8_weight(*model.lm_head.weight.shape, seed=99) * 64)  # peaked, still d q
    return model


def loaded(model: LlamaForCausalLM, name: str) -> LoadedModel:
    return LoadedModel(
        name=name, source=name, model=model, tokenizer=tiny_tokenizer(),
        device=torch.device("cpu"), dtype=torch.float32,
    )


def make_tiny_engine(draft: bool = True, target_seed: int = 0, draft_seed: int = 1) -> Engine:
    """An Engine on a 2-layer random Llama, with a 1-layer random draft model when draft=True."""
    target = loaded(tiny_llama(target_seed), "tiny-target")
    drafter = loaded(tiny_llama(draft_seed, layers=1), "tiny-draft") if draft else None
    return Engine(target, drafter)


def assert_cache_matches_fresh_prefill(model, lm) -> None:
    """The KV cache of a CachedModel equals a fresh prefill of exactly the ids it claims to hold."""
    fresh = DynamicCache()  # full layers only: a sliding-window model's fresh cache keeps every key too
    with torch.inference_mode():
        model(input_ids=torch.tensor([lm.cached_ids]), cache=fresh, use_cache=True)
    for ours, ref in zip(lm._cache.layers, fresh.layers):
        assert ours.keys.shape == ref.keys.shape
        torch.testing.assert_close(ours.keys, ref.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(ours.values, ref.values, atol=1e-5, rtol=1e-4)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """HF generate's greedy continuation of ids (n tokens, no EOS stop): the reference output."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def training_files(folder, model, prompts: int = 10):
    """`model` saved with the tiny tokenizer as a target folder, and a prompts file of `prompts` counting
    instructions: what a `train-drafter` test runs on. Returns (model folder, prompts file)."""
    import json

    model_dir = folder / "tiny-target"
    model.save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    path = folder / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"instruction": f"Count to {i}: one two three"}) for i in range(prompts)))
    return model_dir, path
