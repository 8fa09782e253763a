"""The static-cache forward (engine/runtime/static_forward.py) against HF's forward, on tiny models of
each family it runs: logits equal within float32 rounding, the cache consistent over random steps,
and the CUDA-graph plumbing (padding, masks, slots, regrowth) checked on the CPU with an eager stand-in
for the capture."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.drafters.draft_model import DraftModelDrafter
from speclens.engine.runtime import static_forward
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.static_forward import StaticLlamaForward
from tests.tiny import assert_cache_matches_fresh_prefill, tiny_llama, tiny_tokenizer

ATOL = 1e-5  # float32: HF's forward and this one differ by summation order only

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def family_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `family` with what sets the family apart switched on."""
    torch.manual_seed(seed)
    if family == "llama":  # Llama 3's rope scaling and attention biases
        config = LlamaConfig(**COMMON, attention_bias=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        model = LlamaForCausalLM(config)
    elif family == "mistral":  # a window shorter than the contexts tested
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=12))
    elif family == "qwen2":  # q/k/v biases (HF initialises them to zero: make them count)
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON))
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif family == "qwen3":  # q/k norms over each head (random weights, not the init's ones)
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON, head_dim=16))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    else:
        raise ValueError(family)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked distributions, as trained models have
    return model.eval()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]  # [T, V]


FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf_forward_for_prefill_decode_and_blocks(family):
    model = family_model(family)
    lm = CachedModel(model)
    assert isinstance(lm.lean, StaticLlamaForward) and lm.runtime == "static-cache forward"
    rng = random.Random(1)
    ids = [rng.randrange(96) for _ in range(40)]  # past the Mistral window of 12
    reference = hf_logits(model, ids)
    torch.testing.assert_close(lm.forward(ids[:20], [], 20), reference[:20], atol=ATOL, rtol=0)
    for end in range(21, 30):  # one token a step
        torch.testing.assert_close(lm.forward(ids[:end], [], 1), reference[end - 1 : end], atol=ATOL, rtol=0)
    torch.testing.assert_close(lm.forward(ids[:30], ids[30:36], 7), reference[29:36], atol=ATOL, rtol=0)  # a block
    lm.truncate(25)  # rollback, then a chunked prefill to the end
    assert lm.prefill(ids, chunk=4)
    torch.testing.assert_close(lm.forward(ids, [], 1), reference[-1:], atol=ATOL, rtol=0)
    assert_cache_matches_fresh_prefill(model, lm)


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_equal_each_path_decoded_alone(family):
    model = family_model(family, seed=3)
    lm = CachedModel(model)
    context = list(range(5, 25))
    tokens, parents = [context[-1], 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 3]
    logits = lm.forward_tree(context, tokens, parents)  # [6, V]
    for node in range(1, len(tokens)):
        path, n = [], node
        while n > 0:
            path.insert(0, tokens[n])
            n = parents[n]
        torch.testing.assert_close(logits[node], hf_logits(model, context + path)[-1], atol=ATOL, rtol=0)
    lm.keep_tree_path(tokens, [1, 3, 5])
    assert lm.cached_ids == context + [7, 9, 11]
    assert_cache_matches_fresh_prefill(model, lm)


def random_walk(lm: CachedModel, model, steps: int, seed: int, check_every: int = 1) -> None:
    """`steps` random steps of what decoding does (one token, blocks, rollbacks, trees and their kept
    paths); every step's logits against HF's on the same ids, the cache against a fresh prefill."""
    rng = random.Random(seed)
    vocab = lm.n_vocab
    ids = [rng.randrange(vocab) for _ in range(6)]
    lm.prefill(ids)
    for step in range(steps):
        kind = rng.random()
        if len(ids) > 200:  # keep the model's context and the test's time bounded
            ids = ids[: rng.randrange(4, 40)]
        if kind < 0.3:  # one token
            got, want = lm.forward(ids, [], 1), hf_logits(model, ids)[-1:]
            ids.append(rng.randrange(vocab))
        elif kind < 0.6:  # a verified block, of which a random prefix is kept
            block = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            got, want = lm.forward(ids, block, len(block) + 1), hf_logits(model, ids + block)[-len(block) - 1 :]
            ids += block[: rng.randrange(len(block) + 1)]
        elif kind < 0.7:  # a rollback by a random amount
            ids = ids[: rng.randrange(2, len(ids) + 1)]
            lm.truncate(min(len(lm.cached_ids), len(ids) - 1))
            continue
        else:  # a random tree, one random root-to-node path kept
            n = rng.randrange(2, 10)
            parents = [-1] + [rng.randrange(i) for i in range(1, n)]
            tokens = [ids[-1]] + [rng.randrange(vocab) for _ in range(n - 1)]
            logits = lm.forward_tree(ids, tokens, parents)
            node, path = rng.randrange(n), []
            while node > 0:
                path.insert(0, node)
                node = parents[node]
            lm.keep_tree_path(tokens, path)
            got = logits[[0, *path]]
            want = hf_logits(model, ids + [tokens[i] for i in path])[-len(path) - 1 :]
            ids += [tokens[i] for i in path]
        torch.testing.assert_close(got, want[:, :vocab], atol=ATOL, rtol=0)
        if step % check_every == 0:
            assert_cache_matches_fresh_prefill(model, lm)


@pytest.mark.parametrize("family", FAMILIES)
def test_caches_stay_consistent_over_random_steps(family):
    model = family_model(family, seed=5)
    random_walk(CachedModel(model), model, steps=250, seed=FAMILIES.index(family), check_every=5)  # 1,000 in all


def eager_capture(run, device, pool):
    """Stand-in for torch.cuda.graph capture on the CPU: outputs are fixed tensors, and a replay recomputes
    them in place from the graph's static inputs, as a real replay does."""
    outputs = run()

    class Replay:
        def replay(self):
            for out, new in zip(outputs, run()):
                out.copy_(new)

    return Replay(), outputs


def test_graph_path_pads_masks_and_regrows_like_the_eager_path(monkeypatch):
    """The CUDA-graph plumbing on the CPU: steps padded to GRAPH_SIZES through static buffers, replayed,
    give the eager path's logits; a cache that grows past its capacity drops its stale graphs."""
    monkeypatch.setattr(static_forward, "capture_graph", eager_capture)
    model = family_model("qwen2", seed=7)
    graphed = CachedModel(model)
    graphed.lean.graphs = True
    try:
        random_walk(graphed, model, steps=120, seed=11, check_every=10)
        graphs = graphed._cache.__dict__["speclens_graphs"]
        assert {size for size, _, _ in graphs} <= set(static_forward.GRAPH_SIZES) and len(graphs) >= 3
        long = list(range(90)) * 4  # 360 slots: past the first capacity of 256
        graphed.prefill(long)
        torch.testing.assert_close(graphed.forward(long, [], 1), hf_logits(model, long)[-1:], atol=ATOL, rtol=0)
        assert {capacity for _, capacity, _ in graphs} == {graphed._cache.layers[0].buffers[0].shape[-2]}
    finally:
        graphed.lean.graphs = False


def test_every_method_path_through_it_matches_plain_decoding():
    """Greedy speculative decoding with a draft model, target and draft on the static-cache forward,
    gives plain decoding's tokens (the end-to-end suites run every method on it too)."""
    target, draft = tiny_llama(0), tiny_llama(1, layers=1)
    assert CachedModel(target).runtime == "static-cache forward"
    prompt = tiny_tokenizer()("The capital of France")["input_ids"]
    config = GenerationConfig(max_new_tokens=40, k=4)
    plain = list(generate(CachedModel(target), tiny_tokenizer(), prompt, config, None))[-1]
    drafter = DraftModelDrafter(CachedModel(draft))
    spec = list(generate(CachedModel(target), tiny_tokenizer(), prompt, config, drafter))[-1]
    assert spec.token_ids == plain.token_ids and len(plain.token_ids) == 40


def test_other_architectures_keep_hf_forward_and_say_why():
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    lm = CachedModel(model)
    assert lm.lean is None
    assert lm.runtime == ("HF forward (the static-cache forward does not run it: it knows the Llama, Mistral, "
                          "Qwen2 and Qwen3 families, not GPT2LMHeadModel)")
    ids = [1, 2, 3, 4]
    torch.testing.assert_close(lm.forward(ids, [], 2), hf_logits(model, ids)[-2:], atol=ATOL, rtol=0)
