"""The GPU measurement script's model and loops, on a tiny float32 shape on CPU (CI has no GPU)."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

SCRIPT = Path(__file__).resolve().parents[1] / "packaging" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gb():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_bench"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["gpu_bench"]


def test_grouped_attention_layer_equals_plain_gqa(gb):
    """Folding G query heads into the rows of their key/value head changes no number."""
    torch.manual_seed(0)
    heads, kv_heads, hd, dim, length = 8, 2, 16, 128, 12
    pos = torch.tensor([5, 6, 7])
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    angles = torch.outer(torch.arange(length).float(), 1.0 / 10_000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = angles.cos()[pos], angles.sin()[pos]
    x = torch.randn(3, dim)
    k_cache, v_cache = torch.randn(1, kv_heads, length, hd), torch.randn(1, kv_heads, length, hd)
    w = dict(attn_norm=torch.rand(dim) + 0.5, wqkv=torch.randn((heads + 2 * kv_heads) * hd, dim) / 10,
             wo=torch.randn(dim, heads * hd) / 10, mlp_norm=torch.rand(dim) + 0.5,
             w13=torch.randn(64, dim) / 10, w2=torch.randn(dim, 32) / 10)
    k_ours, v_ours = k_cache.clone(), v_cache.clone()
    out = gb.decoder_layer(x, pos, gb.group_mask(causal, pos, heads // kv_heads), cos, sin, k_ours, v_ours, **w,
                           heads=heads, kv_heads=kv_heads)

    qkv = F.linear(F.rms_norm(x, (dim,), w["attn_norm"], gb.EPS), w["wqkv"]).view(3, heads + 2 * kv_heads, hd)
    q = gb.rope(qkv[:, :heads], cos, sin).transpose(0, 1)[None]
    k = gb.rope(qkv[:, heads : heads + kv_heads], cos, sin).transpose(0, 1)[None]
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, qkv[:, heads + kv_heads :].transpose(0, 1)[None])
    attn = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=causal[pos][None, None], enable_gqa=True)
    h = x + F.linear(attn[0].transpose(0, 1).reshape(3, heads * hd), w["wo"])
    gate, up = F.linear(F.rms_norm(h, (dim,), w["mlp_norm"], gb.EPS), w["w13"]).chunk(2, dim=-1)
    expected = h + F.linear(F.silu(gate) * up, w["w2"])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(k_ours, k_cache)


def test_speculative_decode_with_synthetic_drafter_equals_plain_and_hits_acceptance(gb):
    shape, n, k = gb.TINY, 400, 4
    model = gb.Llama(shape, max_len=16 + 2 * (n + 16) + 8, device=torch.device("cpu"), dtype=torch.float32)
    step = gb.Stepper(model, graphs=False)
    prompt = torch.randint(0, shape.vocab, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    reference, _ = gb.plain_decode(step, prompt, n + 16)
    run = gb.speculative_decode(step, prompt, reference, n, k, acceptance=0.8, seed=1)
    assert run.ids == reference[: len(run.ids)]  # greedy speculation changes no token
    assert run.reanchors == 0
    # Each drafted position is accepted with probability 0.8: ~500 trials, 6 sigma is about 0.11.
    assert abs(run.acceptance - 0.8) < 0.11
    expected = (1 - 0.8 ** (k + 1)) / (1 - 0.8)
    assert abs(run.tokens_per_step - expected) < 0.6
    drafter_off = gb.speculative_decode(step, prompt, reference, 40, k, acceptance=0.0, seed=1)
    assert drafter_off.ids == reference[: len(drafter_off.ids)] and drafter_off.tokens_per_step == 1.0


def test_a_drifted_target_is_followed_and_the_drafter_re_anchored(gb):
    """A reference that parts from the target's greedy path (as bf16 rounding can make it) costs
    speed, never tokens: the output follows the target."""
    model = gb.Llama(gb.TINY, max_len=256, device=torch.device("cpu"), dtype=torch.float32)
    step = gb.Stepper(model, graphs=False)
    prompt = list(range(1, 17))
    reference, _ = gb.plain_decode(step, prompt, 80)
    drifted = reference[:30] + [(t + 1) % gb.TINY.vocab for t in reference[30:]]
    run = gb.speculative_decode(step, prompt, drifted, 60, 4, acceptance=1.0, seed=0)
    assert run.ids == reference[: len(run.ids)]
    assert run.reanchors == 1


def test_script_runs_end_to_end_on_cpu(gb, capsys):
    assert gb.main(["--tiny", "--device", "cpu", "--compile", "no"]) == 0
    out = capsys.readouterr().out
    for heading in ("plain greedy decoding", "verify cost", "draft step cost", "speculative decoding"):
        assert f"## {heading}" in out
    assert "section failed" not in out and "Traceback" not in out
