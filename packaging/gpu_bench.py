"""GPU speed check of the decoding step on a Llama-3.1-8B-shaped random bf16 model (one H200: < 6 min).

Prints:
  1. plain greedy tokens/s (eager and CUDA-graph) against the memory-bandwidth limit
     (limit = bandwidth / weight bytes: every weight is read once per step);
  2. the verify-cost curve: the time of one forward of T = 1..64 tokens, relative to T = 1;
  3. speculative tokens/s with the synthetic drafter (engine/drafters/synthetic.py) at acceptance
     a = 0.6, 0.8, 0.9 and K = 4, 8, next to the expected tokens per step (1 - a^(K+1)) / (1 - a).

The model is our own gpt-fast-style Llama (no transformers): a static KV cache indexed by position,
so a rollback after a rejection costs nothing (stale slots lie past every later query's position and
are masked, then overwritten), and every step has fixed shapes, so it is captured once per block
size with torch.cuda.CUDAGraph and replayed. Random weights: speed does not depend on their values;
the output layer is scaled up so that greedy argmaxes are not near-ties that bf16 noise could flip.

    python packaging/gpu_bench.py                      # the real run, on CUDA
    python packaging/gpu_bench.py --tiny --device cpu  # a seconds-long check that it runs anywhere
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from engine.drafters.synthetic import SyntheticDrafter  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402


@dataclass(frozen=True)
class Shape:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float = 500_000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


LLAMA_31_8B = Shape(vocab=128_256, dim=4096, layers=32, heads=32, kv_heads=8, ffn=14_336)
TINY = Shape(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=128)


class Llama(torch.nn.Module):
    """Decoder-only Llama with a static KV cache: forward(tokens [T], pos [T]) -> logits [T, V]."""

    def __init__(self, shape: Shape, max_len: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
        super().__init__()
        g = torch.Generator(device=device).manual_seed(seed)
        s, hd = shape, shape.head_dim

        def w(*size, std=0.02):
            return torch.randn(*size, generator=g, device=device, dtype=dtype) * std

        self.shape = shape
        self.embed = w(s.vocab, s.dim)
        self.layer_weights = [
            dict(
                attn_norm=torch.ones(s.dim, device=device, dtype=dtype),
                wqkv=w((s.heads + 2 * s.kv_heads) * hd, s.dim),
                wo=w(s.dim, s.heads * hd),
                mlp_norm=torch.ones(s.dim, device=device, dtype=dtype),
                w13=w(2 * s.ffn, s.dim),
                w2=w(s.dim, s.ffn),
            )
            for _ in range(s.layers)
        ]
        self.norm = torch.ones(s.dim, device=device, dtype=dtype)
        self.output = w(s.vocab, s.dim, std=1.0)  # peaked logits: argmax robust to rounding
        self.k_cache = torch.zeros(s.layers, 1, s.kv_heads, max_len, hd, device=device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)
        freqs = 1.0 / s.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd)
        angles = torch.outer(torch.arange(max_len, device=device).float(), freqs)  # [max_len, hd/2]
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm, self.output] + [t for lw in self.layer_weights for t in lw.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s, hd = self.shape, self.shape.head_dim
        t = tokens.shape[0]
        x = self.embed[tokens]  # [T, D]
        mask = self.causal[pos][None, None]  # [1, 1, T, max_len]: a query sees positions <= its own
        cos, sin = self.cos[pos], self.sin[pos]  # [T, hd/2]
        for i, lw in enumerate(self.layer_weights):
            qkv = F.linear(rms_norm(x, lw["attn_norm"]), lw["wqkv"])
            q, k, v = qkv.split([s.heads * hd, s.kv_heads * hd, s.kv_heads * hd], dim=-1)
            q = rope(q.view(t, s.heads, hd), cos, sin).transpose(0, 1)[None]  # [1, H, T, hd]
            k = rope(k.view(t, s.kv_heads, hd), cos, sin).transpose(0, 1)[None]  # [1, KV, T, hd]
            v = v.view(t, s.kv_heads, hd).transpose(0, 1)[None]
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v)
            attn = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(attn[0].transpose(0, 1).reshape(t, s.heads * hd), lw["wo"])
            gate, up = F.linear(rms_norm(x, lw["mlp_norm"]), lw["w13"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, lw["w2"])
        return F.linear(rms_norm(x, self.norm), self.output)  # [T, V]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, hd] with cos/sin [T, hd/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class Stepper:
    """Greedy next tokens for a block of T tokens starting at position `start`.

    With graphs, each block size is captured once (static token/position inputs, argmax output) and
    replayed; the only host work per step is two small copies in and one out.
    """

    def __init__(self, model: Llama, graphs: bool):
        self.model = model
        self.graphs = graphs
        self.device = model.embed.device
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    @torch.inference_mode()
    def __call__(self, tokens: list[int], start: int) -> list[int]:
        t = len(tokens)
        tok = torch.tensor(tokens, dtype=torch.long)
        pos = torch.arange(start, start + t)
        if not self.graphs:
            return self.model(tok.to(self.device), pos.to(self.device)).argmax(-1).tolist()
        graph, tok_in, pos_in, out = self.captured.get(t) or self.capture(t, start)
        tok_in.copy_(tok, non_blocking=True)
        pos_in.copy_(pos, non_blocking=True)
        graph.replay()
        return out.tolist()

    def capture(self, t: int, start: int):
        # Warm-up and capture write keys/values at the given positions: callers pass a real `start`,
        # whose slots the replay that follows rewrites anyway.
        tok_in = torch.zeros(t, dtype=torch.long, device=self.device)
        pos_in = torch.arange(start, start + t, device=self.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model(tok_in, pos_in).argmax(-1)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(tok_in, pos_in).argmax(-1)
        self.captured[t] = (graph, tok_in, pos_in, out)
        return self.captured[t]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: Llama, prompt: list[int]) -> None:
    device = model.embed.device
    model(torch.tensor(prompt[:-1], device=device), torch.arange(len(prompt) - 1, device=device))


def plain_decode(step: Stepper, prompt: list[int], n: int) -> tuple[list[int], float]:
    """prompt + n greedy tokens, and tokens/s (prefill of prompt[:-1] excluded)."""
    prefill(step.model, prompt)
    ids = list(prompt)
    sync(step.device)
    start = time.perf_counter()
    for _ in range(n):
        ids.append(step([ids[-1]], len(ids) - 1)[0])
    sync(step.device)
    return ids, n / (time.perf_counter() - start)


def speculative_decode(step: Stepper, drafter: SyntheticDrafter, prompt: list[int], n: int, k: int):
    """Greedy chain speculation; returns (ids, tokens/s, tokens per step, measured acceptance)."""
    prefill(step.model, prompt)
    ids = list(prompt)
    steps = accepted = rejected = 0
    params = SamplingParams()
    sync(step.device)
    start = time.perf_counter()
    while len(ids) - len(prompt) < n:
        kk = min(k, n - (len(ids) - len(prompt)) - 1)
        draft = drafter.propose(ids, kk, params, None).tokens.tolist() if kk > 0 else []
        target = step([ids[-1]] + draft, len(ids) - 1)  # argmax after each block position
        n_ok = next((i for i, (d, t) in enumerate(zip(draft, target)) if d != t), len(draft))
        ids += draft[:n_ok] + [target[n_ok]]  # stale cache slots past here are masked, then rewritten
        steps += 1
        accepted += n_ok
        rejected += n_ok < len(draft)
    sync(step.device)
    seconds = time.perf_counter() - start
    new = len(ids) - len(prompt)
    return ids, new / seconds, new / steps, accepted / max(accepted + rejected, 1)


def time_block(step: Stepper, t: int, start: int, reps: int) -> float:
    tokens = [1] * t
    step(tokens, start)  # capture / warm
    sync(step.device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step(tokens, start)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, float32: checks the script runs")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="memory bandwidth, bytes/s (H200: 4.8e12)")
    parser.add_argument("--context", type=int, default=512, help="prompt length (random ids)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-block", type=int, default=64)
    parser.add_argument("--no-graphs", action="store_true", help="eager only")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --tiny --device cpu to check the script", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else LLAMA_31_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    context, new, max_block = (64, 32, 16) if args.tiny else (args.context, args.new_tokens, args.max_block)
    max_len = context + new + max_block + 8
    graphs = device.type == "cuda" and not args.no_graphs
    reps = 5 if args.tiny else 20

    t0 = time.perf_counter()
    model = Llama(shape, max_len, device, dtype)
    sync(device)
    weight_bytes = model.weight_bytes()
    limit = args.bandwidth / weight_bytes
    name = "tiny" if args.tiny else "Llama-3.1-8B shape"
    print(f"{name}: {weight_bytes / 1e9:.2f} GB of {str(dtype).removeprefix('torch.')} weights on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
          + f", built in {time.perf_counter() - t0:.1f} s; context {context}, {new} new tokens")
    print(f"bandwidth limit: {args.bandwidth / 1e12:.1f} TB/s / {weight_bytes / 1e9:.2f} GB = {limit:.0f} tok/s")

    prompt = torch.randint(0, shape.vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    modes = [("eager", Stepper(model, graphs=False))] + ([("cuda graph", Stepper(model, graphs=True))] if graphs else [])
    fastest = modes[-1][1]
    print("\n## plain greedy decoding")
    reference: list[int] = []
    for label, step in modes:
        plain_decode(step, prompt, 4)  # warm-up (and graph capture)
        ids, rate = plain_decode(step, prompt, new + max_block)
        reference = reference or ids
        agree = sum(a == b for a, b in zip(ids, reference)) / len(ids)
        print(f"{label:>10}: {rate:8.1f} tok/s = {rate / limit:6.1%} of the bandwidth limit"
              + (f" (tokens equal to eager: {agree:.1%})" if label != "eager" else ""))

    print(f"\n## verify cost: one forward of T tokens at position {context} ({modes[-1][0]}), relative to T = 1")
    base = None
    cells = []
    for t in range(1, max_block + 1):
        seconds = time_block(fastest, t, context, reps)
        base = base or seconds
        cells.append(f"T={t}: {seconds * 1e3:.2f} ms ({seconds / base:.2f}x)")
    for i in range(0, len(cells), 4):
        print("  " + "   ".join(cells[i : i + 4]))

    print(f"\n## speculative decoding, synthetic drafter ({modes[-1][0]}; reference = greedy continuation above)")
    print(f"{'a':>5} {'K':>3} {'tok/s':>9} {'speedup':>8} {'tokens/step':>12} {'expected':>9} {'measured a':>11}"
          f" {'= plain':>8}")
    _, plain_rate = plain_decode(fastest, prompt, new)
    for k in (4, 8):
        for a in (0.6, 0.8, 0.9):
            drafter = SyntheticDrafter(reference, a, shape.vocab, seed=0)
            speculative_decode(fastest, drafter, prompt, 8, k)  # capture the K+1 graph
            drafter = SyntheticDrafter(reference, a, shape.vocab, seed=1)
            ids, rate, per_step, measured = speculative_decode(fastest, drafter, prompt, new, k)
            expected = (1 - a ** (k + 1)) / (1 - a)
            same = "yes" if ids == reference[: len(ids)] else "NO"  # greedy speculation must not change tokens
            print(f"{a:5.1f} {k:3d} {rate:9.1f} {rate / plain_rate:7.2f}x {per_step:12.2f} {expected:9.2f}"
                  f" {measured:11.2f} {same:>8}")
    print(f"(plain, same mode: {plain_rate:.1f} tok/s; total {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
