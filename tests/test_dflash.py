"""DFlash parallel drafters (engine/drafters/dflash.py): a checkpoint written here in z-lab's layout
loads without remote code, one forward proposes what the layout's math says (a reference written from
its description), and decoding through the Engine gives plain decoding's tokens."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.drafters.dflash import DFlashHead, default_target_layers
from speclens.engine.session import Engine, EngineError
from tests.tiny import loaded, tiny_llama, training_files

BLOCK, MASK, TARGET_LAYERS, DRAFT_LAYERS = 4, 3, (0, 2), 2


def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def write_zlab_checkpoint(folder, target, seed=0, layer_ids=TARGET_LAYERS, mask=MASK, hidden=None):
    """A random DFlash drafter for `target` as z-lab publishes one: Qwen3-style layers with q/k norms,
    fc over the target layers' outputs, hidden_norm, norm; no embedding or LM head; remote-code
    auto_map in the config (never run)."""
    config = target.config
    hidden = hidden or config.hidden_size
    heads, kv_heads, hd, inter = 4, 2, 16, 2 * hidden
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.15):
        return torch.randn(*shape, generator=g) * std

    n = len(layer_ids) if layer_ids else DRAFT_LAYERS
    state = {"fc.weight": w(hidden, n * hidden), "hidden_norm.weight": 1 + w(hidden), "norm.weight": 1 + w(hidden)}
    for layer in range(DRAFT_LAYERS):
        p = f"layers.{layer}."
        state.update({
            p + "input_layernorm.weight": 1 + w(hidden), p + "post_attention_layernorm.weight": 1 + w(hidden),
            p + "self_attn.q_proj.weight": w(heads * hd, hidden), p + "self_attn.k_proj.weight": w(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * hd, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * hd),
            p + "self_attn.q_norm.weight": 1 + w(hd), p + "self_attn.k_norm.weight": 1 + w(hd),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        })
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    raw = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "model_type": "qwen3", "block_size": BLOCK, "num_target_layers": config.num_hidden_layers,
           "num_hidden_layers": DRAFT_LAYERS, "hidden_size": hidden, "intermediate_size": inter,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": hd, "hidden_act": "silu",
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
           "vocab_size": config.vocab_size, "tie_word_embeddings": False,
           "dflash_config": {"mask_token_id": mask, **({"target_layer_ids": list(layer_ids)} if layer_ids else {})}}
    (folder / "config.json").write_text(json.dumps(raw))
    return state


def reference_block(state, model, ids, layer_ids=TARGET_LAYERS):
    """The layout's math, written out: C = hidden_norm(fc([outputs of layer_ids])) over positions
    0..s-1; the block [ids[-1], MASK...] at s..s+B-1 through each layer, attending to k/v of C (k norm,
    RoPE) and of the block (no mask); rows 1.. through norm and the target's LM head -> argmax."""
    hd, s = 16, len(ids) - 1
    with torch.inference_mode():
        states = model(input_ids=torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        fused = torch.cat([states[i + 1][0] for i in layer_ids], dim=-1)  # [s, nH]
        c = rms(fused @ state["fc.weight"].T, state["hidden_norm.weight"])
        inv = 1.0 / 10000.0 ** (torch.arange(0, hd, 2).float() / hd)

        def rope(t, positions):  # t [n, heads, hd]
            angle = torch.outer(positions.float(), inv).repeat(1, 2)[:, None]
            return t * angle.cos() + torch.cat([-t[..., hd // 2 :], t[..., : hd // 2]], -1) * angle.sin()

        emb = model.get_input_embeddings()(torch.tensor([ids[-1]] + [MASK] * (BLOCK - 1)))
        h = emb
        for layer in range(DRAFT_LAYERS):
            p = f"layers.{layer}.self_attn."
            x = rms(h, state[f"layers.{layer}.input_layernorm.weight"])
            q = rope(rms((x @ state[p + "q_proj.weight"].T).view(BLOCK, 4, hd), state[p + "q_norm.weight"]),
                     torch.arange(s, s + BLOCK))
            kx = torch.cat([c, x])  # context rows, then the block's
            k = rope(rms((kx @ state[p + "k_proj.weight"].T).view(-1, 2, hd), state[p + "k_norm.weight"]),
                     torch.arange(0, s + BLOCK))
            v = (kx @ state[p + "v_proj.weight"].T).view(-1, 2, hd)
            k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # [n, heads, hd]
            scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
            out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(BLOCK, -1)
            h = h + out @ state[p + "o_proj.weight"].T
            m = rms(h, state[f"layers.{layer}.post_attention_layernorm.weight"])
            mp = f"layers.{layer}.mlp."
            h = h + (torch.nn.functional.silu(m @ state[mp + "gate_proj.weight"].T) * (m @ state[mp + "up_proj.weight"].T)
                     ) @ state[mp + "down_proj.weight"].T
        rows = rms(h, state["norm.weight"])[1:]
        return model.lm_head(rows).argmax(-1)  # [B - 1]


def engine_with(tmp_path, **kwargs):
    target = tiny_llama(layers=4)
    state = write_zlab_checkpoint(tmp_path / "dflash", target, **kwargs)
    return Engine(loaded(target, "tiny-4"), None, (str(tmp_path / "dflash"),)), state


def test_one_forward_proposes_the_layouts_block(tmp_path):
    engine, state = engine_with(tmp_path)
    drafter = engine.drafter("dflash")
    assert drafter.feature_layers == (1, 3) and drafter.block_size == BLOCK  # outputs of layers 0 and 2
    for prompt in ("one two three four five", "The capital of France is"):
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        engine.target_lm.reset()
        engine.target_lm.prefill(ids)
        drafter.prefill(ids)
        draft = drafter.propose(ids, BLOCK - 1, SamplingParams(), None)
        assert draft.probs is None and draft.tokens.tolist() == reference_block(state, engine.target.model, ids).tolist()
        shorter = drafter.propose(ids, 2, SamplingParams(), None)  # the block stays whole: the same first two
        assert shorter.tokens.tolist() == draft.tokens.tolist()[:2]


@pytest.mark.parametrize("layer_ids", [TARGET_LAYERS, None])
def test_decoding_through_the_engine_equals_plain_decoding(tmp_path, layer_ids):
    engine, _ = engine_with(tmp_path, layer_ids=layer_ids)
    assert "dflash" in engine.methods
    if layer_ids is None:
        assert engine.drafter("dflash").layer_ids == default_target_layers(4, DRAFT_LAYERS)
    for prompt in ("The capital of France", "def add(a, b):"):
        ids = engine.encode_chat([{"role": "user", "content": prompt}])
        plain = list(engine.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=40)))[-1]
        for k in (3, 8):  # K past the block is cut to block_size - 1
            spec = list(engine.generate_ids(ids, GenerationConfig(method="dflash", k=k, max_new_tokens=40)))[-1]
            assert spec.token_ids == plain.token_ids and spec.drafted > 0
            assert spec.drafted <= spec.steps * (BLOCK - 1)


def test_sampled_drafts_carry_the_distributions_they_came_from(tmp_path):
    engine, _ = engine_with(tmp_path)
    drafter = engine.drafter("dflash")
    ids = engine.encode_chat([{"role": "user", "content": "one two three"}])
    engine.target_lm.prefill(ids)
    draft = drafter.propose(ids, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert draft.probs.shape == (3, engine.target_lm.n_vocab)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens.tolist()))


def test_z_labs_default_layer_ids():
    assert default_target_layers(36, 5) == (1, 9, 17, 25, 33)


@pytest.mark.parametrize("kwargs, words", [({"hidden": 32}, "width 32"), ({"mask": 10_000}, "mask token 10000"),
                                           ({"layer_ids": (0, 7)}, "target layers (0, 7)")])
def test_a_drafter_for_another_target_is_refused_in_one_line(tmp_path, kwargs, words):
    with pytest.raises(EngineError, match=rf"DFlash drafter .* {words[:12]}.*another model"):
        engine_with(tmp_path, **kwargs)


def test_loading_needs_no_remote_code_and_ignores_auto_map(tmp_path):
    target = tiny_llama(layers=4)
    write_zlab_checkpoint(tmp_path / "d", target)
    head = DFlashHead.load(tmp_path / "d")
    assert head.block_size == BLOCK and head.mask_token_id == MASK and head.target_layer_ids == TARGET_LAYERS
    assert not (tmp_path / "d" / "dflash.py").exists()  # nothing to run: the layers are ours


def test_train_drafter_trains_a_dflash_drafter_that_the_engine_loads(tmp_path):
    """`--kind dflash`: blocks at random anchors learn the target's next tokens; the drafter is saved
    in z-lab's layout, its loss falls, and the Engine decodes exactly with it."""
    from speclens.engine.tools.cli import main

    target = tiny_llama(layers=4)
    model_dir, prompts = training_files(tmp_path, target)
    out = tmp_path / "dflash"
    assert main(["train-drafter", "--kind", "dflash", "--target", str(model_dir), "--prompts", str(prompts),
                 "--out", str(out), "--held-out", "2", "--answer-tokens", "16", "--epochs", "6", "--eval-tokens", "8",
                 "--batch-size", "4", "--lr", "3e-3", "--block-size", "6", "--anchors", "3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 6
    assert config["dflash_config"]["mask_token_id"] == target.config.vocab_size - 1
    assert config["speclens_init"] == "the target's last layers"
    record = json.loads((out / "training.json").read_text())
    assert record["history"][-1]["loss"] < record["history"][0]["loss"]
    assert set(record["tau"]) == {"block"} and "DFlash" in (out / "README.md").read_text()
    engine = Engine(loaded(target, "tiny-4"), None, (str(out),))
    ids = engine.encode_chat([{"role": "user", "content": "Count to 3: one two three"}])
    plain = list(engine.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=24)))[-1].token_ids
    spec = list(engine.generate_ids(ids, GenerationConfig(method="dflash", k=5, max_new_tokens=24)))[-1]
    assert spec.token_ids == plain and spec.drafted > 0


def test_training_blocks_see_the_context_before_their_anchor_and_their_own_block():
    from speclens.engine.tools.train.dflash import block_mask

    mask = block_mask(5, [2, 4], 3)
    assert mask.shape == (6, 11)
    assert mask[0, :5].tolist() == [True, True, False, False, False] and mask[0, 5:8].all() and not mask[0, 8:].any()
    assert mask[4, :5].tolist() == [True] * 4 + [False] and mask[4, 8:].all() and not mask[4, 5:8].any()
