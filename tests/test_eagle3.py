"""EAGLE-3 heads (engine/drafters/eagle3.py): a checkpoint written here in the SafeAILab / SpecForge
layout loads, its math is the layout's (checked against a reference written from the layout's
description), the target's fused features are HF's hidden states, and decoding through the Engine
gives plain decoding's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.drafters.eagle3 import Eagle3Head, default_feature_layers
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.runtime.models import _use_cpu_kernels
from speclens.engine.session import Engine, EngineError
from tests.native import needs_native
from tests.tiny import loaded, tiny_llama, tiny_tokenizer, training_files

DRAFT_VOCAB = 160
LAYERS = (1, 2, 3)  # of a 4-layer target


def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def write_specforge_checkpoint(folder, target, layers=LAYERS, seed=0, vocab=None, in_eagle_config=False):
    """A random EAGLE-3 head for `target` as SpecForge saves one: config with draft_vocab_size and the
    aux layer ids, `midlayer.*`, `fc` over three target states, its own norm and LM head, d2t / t2d, and
    an embed_tokens copy (which loading ignores). Returns the state dict."""
    config = target.config
    hidden, inter = config.hidden_size, config.intermediate_size
    heads, kv_heads, hd = config.num_attention_heads, config.num_key_value_heads, config.hidden_size // 4
    vocab = vocab or config.vocab_size
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    draft_ids = torch.randperm(vocab, generator=g)[:DRAFT_VOCAB].sort().values  # target ids the head drafts
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    state = {
        "fc.weight": w(hidden, 3 * hidden),
        "midlayer.input_layernorm.weight": 1 + w(hidden),
        "midlayer.hidden_norm.weight": 1 + w(hidden),
        "midlayer.post_attention_layernorm.weight": 1 + w(hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * hd, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * hd, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "norm.weight": 1 + w(hidden),
        "lm_head.weight": w(DRAFT_VOCAB, hidden, std=2.0),
        "d2t": draft_ids - torch.arange(DRAFT_VOCAB),  # target id = draft id + d2t[draft id]
        "t2d": t2d,
        "embed_tokens.weight": w(vocab, hidden),
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
           "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab, "draft_vocab_size": DRAFT_VOCAB,
           "max_position_embeddings": 1024, "hidden_act": "silu", "rope_theta": 10000.0, "tie_word_embeddings": False}
    if layers is not None:
        if in_eagle_config:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
        else:
            raw["eagle_aux_hidden_state_layer_ids"] = list(layers)
    (folder / "config.json").write_text(json.dumps(raw))
    return state


def reference_step(state, embed, fused, position, keys, values, hd):
    """One EAGLE-3 step from the layout's description, one token: g = fc(fused); x = [norm(e); norm(g)];
    attention over the cached keys/values and its own; g' = g + o(attn) + mlp(norm(...))."""
    p = "midlayer."
    g = fused @ state["fc.weight"].T
    x = torch.cat([rms(embed, state[p + "input_layernorm.weight"]), rms(g, state[p + "hidden_norm.weight"])])
    q = (x @ state[p + "self_attn.q_proj.weight"].T).view(-1, hd)  # [heads, hd]
    k = (x @ state[p + "self_attn.k_proj.weight"].T).view(-1, hd)  # [kv heads, hd]
    v = (x @ state[p + "self_attn.v_proj.weight"].T).view(-1, hd)
    inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)
    angle = torch.cat([position * inv, position * inv])
    rot = lambda t: t * angle.cos() + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * angle.sin()  # noqa: E731
    q, k = rot(q), rot(k)
    keys, values = torch.cat([keys, k[:, None]], 1), torch.cat([values, v[:, None]], 1)  # [kv, n + 1, hd]
    group = q.shape[0] // k.shape[0]
    scores = torch.einsum("hd,hnd->hn", q, keys.repeat_interleave(group, 0)) / hd**0.5
    attn = torch.einsum("hn,hnd->hd", scores.softmax(-1), values.repeat_interleave(group, 0)).reshape(-1)
    h = g + attn @ state[p + "self_attn.o_proj.weight"].T
    m = rms(h, state[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ state[p + "mlp.gate_proj.weight"].T) * (m @ state[p + "mlp.up_proj.weight"].T))
    return h + mlp @ state[p + "mlp.down_proj.weight"].T, keys, values


def test_the_head_computes_what_the_layout_describes(tmp_path):
    target = tiny_llama(layers=4)
    state = write_specforge_checkpoint(tmp_path / "head", target)
    head = Eagle3Head.load(tmp_path / "head")
    assert head.feature_layers == LAYERS and head.lm_head.out_features == DRAFT_VOCAB
    assert torch.equal(head.draft_vocab, torch.nonzero(state["t2d"])[:, 0])  # d2t and t2d agree
    hidden, hd = target.config.hidden_size, target.config.hidden_size // 4
    g = torch.Generator().manual_seed(3)
    embeds, fused = torch.randn(3, hidden, generator=g), torch.randn(3, 3 * hidden, generator=g)
    with torch.inference_mode():
        ours = head(embeds, fused, torch.arange(3), torch.ones(3, 3, dtype=torch.bool).tril())  # [3, H]
        keys = values = torch.zeros(2, 0, hd)
        for i in range(3):
            want, keys, values = reference_step(state, embeds[i], fused[i], float(i), keys, values, hd)
            torch.testing.assert_close(ours[i], want, atol=1e-4, rtol=1e-4)
        deeper = head(embeds[:1], ours[:1], torch.tensor([0]), torch.ones(1, 1, dtype=torch.bool))  # no fc
        torch.testing.assert_close(deeper[0], reference_step(
            {**state, "fc.weight": torch.eye(hidden)}, embeds[0], ours[0], 0.0, torch.zeros(2, 0, hd),
            torch.zeros(2, 0, hd), hd)[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("runtime", ["static", "hf"])
def test_the_targets_fused_features_are_hfs_hidden_states(runtime):
    model = tiny_llama(layers=4)
    lm = CachedModel(model)
    if runtime == "hf":
        lm.lean = None
        lm.reset()
    lm.request_features(LAYERS)
    ids = tiny_tokenizer()("one two three four five six")["input_ids"]
    lm.prefill(ids, chunk=3)
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
    want = torch.cat([states[j][0] for j in LAYERS], dim=-1)  # [T, 3H]
    torch.testing.assert_close(lm.features_at(0, len(ids) - 1, LAYERS), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lm.hidden_at(0, len(ids) - 1), states[-1][0], atol=1e-5, rtol=1e-5)
    lm.forward_tree(ids[:-1], [ids[-2], 5, 6, 7], [-1, 0, 1, 0])
    lm.keep_tree_path([ids[-2], 5, 6, 7], [1, 2])  # the kept path's features are the path's
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids[:-1] + [5, 6]]), output_hidden_states=True).hidden_states
    got = lm.features_at(len(ids) - 2, len(ids) + 1, LAYERS)
    torch.testing.assert_close(got, torch.cat([states[j][0, -3:] for j in LAYERS], -1), atol=1e-5, rtol=1e-5)


def engine_with_head(tmp_path, **kwargs) -> Engine:
    target = tiny_llama(layers=4)
    write_specforge_checkpoint(tmp_path / "eagle3", target, **kwargs)
    return Engine(loaded(target, "tiny-4"), None, (str(tmp_path / "eagle3"),))


@pytest.mark.parametrize("layers, in_eagle_config", [(LAYERS, False), (LAYERS, True), (None, False)])
def test_decoding_through_the_engine_equals_plain_decoding(tmp_path, layers, in_eagle_config):
    engine = engine_with_head(tmp_path, layers=layers, in_eagle_config=in_eagle_config)
    assert {"eagle3", "eagle3_chain"} <= set(engine.methods)
    drafter = engine.drafter("eagle3")
    assert drafter.feature_layers == (layers or default_feature_layers(4))
    for prompt in ("The capital of France", "def add(a, b):"):
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        outputs = {}
        for method in ("ar", "eagle3", "eagle3_chain"):
            summary = list(engine.generate_ids(ids, GenerationConfig(method=method, k=3, max_new_tokens=40)))[-1]
            outputs[method] = summary.token_ids
            if method != "ar":
                assert summary.steps <= summary.new_tokens  # drafted tokens were verified
        assert outputs["eagle3"] == outputs["ar"] == outputs["eagle3_chain"] and len(outputs["ar"]) == 40


def test_a_head_for_another_target_is_refused_in_one_line(tmp_path):
    target = tiny_llama(layers=4)
    write_specforge_checkpoint(tmp_path / "other", target, vocab=target.config.vocab_size + 8)
    with pytest.raises(EngineError, match="EAGLE-3 head .* vocabulary .* another model"):
        Engine(loaded(target, "tiny-4"), None, (str(tmp_path / "other"),))


def test_save_writes_the_layout_load_reads(tmp_path):
    target = tiny_llama(layers=4)
    write_specforge_checkpoint(tmp_path / "a", target)
    head = Eagle3Head.load(tmp_path / "a")
    head.save(tmp_path / "b")
    again = Eagle3Head.load(tmp_path / "b")
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert again.feature_layers == LAYERS


def test_the_chain_drafts_the_heads_argmax_through_d2t(tmp_path):
    """The first drafted token is what the layout says: the head over every committed position (fused
    target states of LAYERS, the next token's embedding), its norm and LM head, argmax, then d2t."""
    from speclens.engine.decoding.sampling import SamplingParams

    engine = engine_with_head(tmp_path)
    model, drafter = engine.target.model, engine.drafter("eagle3_chain")
    head = Eagle3Head.load(tmp_path / "eagle3")
    ids = engine.encode_chat([{"role": "user", "content": "one two three four five"}])
    engine.target_lm.prefill(ids)
    drafter.prefill(ids)
    tree = drafter.propose_tree(ids, 3, SamplingParams(), None)
    assert len(tree) == 4 and tree.parents == (-1, 0, 1, 2)
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        fused = torch.cat([states[j][0] for j in LAYERS], dim=-1)  # [L - 1, 3H]
        embeds = model.get_input_embeddings()(torch.tensor(ids[1:]))  # token i + 1 beside features i
        n = len(ids) - 1
        out = head(embeds, fused, torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril())
        draft_id = head.lm_head(head.norm(out[-1])).argmax()
    assert int(tree.tokens[1]) == int(draft_id + head.d2t[draft_id])
    assert int(tree.tokens[1]) in head.draft_vocab.tolist()


@needs_native
def test_a_target_on_the_native_decoder_keeps_it_for_its_features(tmp_path):
    """The native decoder returns the inner layers' states too (it runs in stretches between them): a
    target on it stays on it with an EAGLE-3 head loaded, and greedy decoding still equals plain."""
    model = tiny_llama(layers=4)
    _use_cpu_kernels(model, "native", torch.float32, lambda *a: None)
    write_specforge_checkpoint(tmp_path / "eagle3", tiny_llama(layers=4))
    plain = Engine(loaded(model, "tiny-4"))
    assert plain.target_lm.runtime == "native lean forward"
    ids = plain.encode_chat([{"role": "user", "content": "The capital of France"}])
    want = list(plain.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=30)))[-1].token_ids
    engine = Engine(loaded(model, "tiny-4"), None, (str(tmp_path / "eagle3"),))
    assert engine.target_lm.runtime == "native lean forward" and engine.target_lm.feature_layers
    for method in ("ar", "eagle3", "eagle3_chain"):
        assert list(engine.generate_ids(ids, GenerationConfig(method=method, k=3, max_new_tokens=30)))[-1].token_ids == want


def test_train_drafter_trains_an_eagle3_head_that_the_engine_loads(tmp_path):
    """`--kind eagle3`: distilled samples carry the three target layers' states, training-time test runs,
    the head is saved in the SpecForge layout, its loss falls, and the Engine decodes exactly with it."""
    from safetensors import safe_open

    from speclens.engine.tools.cli import main

    target = tiny_llama(layers=4)
    model_dir, prompts = training_files(tmp_path, target)
    out = tmp_path / "eagle3"
    assert main(["train-drafter", "--kind", "eagle3", "--target", str(model_dir), "--prompts", str(prompts),
                 "--out", str(out), "--held-out", "2", "--answer-tokens", "12", "--epochs", "6", "--eval-tokens", "8",
                 "--depth", "3", "--unroll", "2", "--draft-vocab", "64", "--batch-size", "4", "--lr", "3e-3"]) == 0
    distilled = torch.load(out / "distilled.pt", weights_only=True)
    layers = default_feature_layers(4)
    with torch.inference_mode():
        states = target(input_ids=distilled[0]["tokens"][None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(distilled[0]["fused"].float(), torch.cat([states[j][0] for j in layers], -1),
                               atol=0.05, rtol=0.02)
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= keys
    config = json.loads((out / "config.json").read_text())
    assert config["draft_vocab_size"] <= 64 and config["architectures"] == ["LlamaForCausalLMEagle3"]
    record = json.loads((out / "training.json").read_text())
    assert record["history"][-1]["loss"] < record["history"][0]["loss"]
    assert set(record["tau"]) == {"chain", "tree"} and "EAGLE-3" in (out / "README.md").read_text()
    engine = Engine(loaded(target, "tiny-4"), None, (str(out),))
    ids = engine.encode_chat([{"role": "user", "content": "Count to 3: one two three"}])
    plain = list(engine.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=24)))[-1].token_ids
    for method in ("eagle3", "eagle3_chain"):
        assert list(engine.generate_ids(ids, GenerationConfig(method=method, k=3, max_new_tokens=24)))[-1].token_ids == plain
