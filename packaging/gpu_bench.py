"""GPU speed check of the decoding step on a Llama-3.1-8B-shaped random bf16 model (one H200: < 6 min).

Prints:
  1. the measured copy bandwidth, and plain greedy tokens/s (eager, CUDA graph, CUDA graph over a
     torch.compile'd decoder layer) against the bandwidth limit (every weight is read once per step);
  2. the verify-cost curve: the time of one forward of T = 1..64 tokens, relative to T = 1;
  3. the draft-step cost c of an EAGLE-shaped head (fc + one decoder layer + LM head, full or reduced
     draft vocabulary), captured as a CUDA graph too;
  4. speculative tokens/s with the synthetic drafter (engine/drafters/synthetic.py) at acceptance
     a = 0.6, 0.8, 0.9 and K = 4, 8, next to E = (1 - a^(K+1)) / (1 - a) and the ceiling E / (1 + v)
     (Leviathan et al. 2023, with v = verify cost of K+1 tokens over 1, minus 1; the drafter is free).

The model is our own gpt-fast-style Llama (no transformers): a static KV cache indexed by position,
so a rollback after a rejection costs nothing (stale slots lie past every later query's position and
are masked, then overwritten), and every step has fixed shapes, so it is captured once per block
size with torch.cuda.CUDAGraph and replayed. Random weights: speed does not depend on their values;
the output layer is scaled up so that greedy argmaxes are rarely near-ties that bf16 noise could flip.
Where one still flips (a block of K+1 tokens runs other matrix kernels than a single token), the
speculative output follows the target and the synthetic drafter is re-anchored on the new greedy path,
outside the timed region; the table counts those re-anchorings.

    python packaging/gpu_bench.py                      # the real run, on CUDA
    python packaging/gpu_bench.py --tiny --device cpu  # a seconds-long check that it runs anywhere
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from speclens.engine.decoding.sampling import SamplingParams  # noqa: E402
from speclens.engine.drafters.synthetic import SyntheticDrafter  # noqa: E402

EPS = 1e-5


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


def decoder_layer(x, pos, mask, cos, sin, k_cache, v_cache, attn_norm, wqkv, wo, mlp_norm, w13, w2,
                  heads: int, kv_heads: int):
    """One Llama block on x [T, D] at positions pos [T]; writes its keys/values into the static
    caches [1, KV, L, hd] first, then attends under mask [1, 1, G*T, L] (G = heads / kv_heads: the
    causal rows repeated once per query head sharing a key/value head, see group_mask)."""
    t, hd, group = x.shape[0], 2 * cos.shape[-1], heads // kv_heads
    qkv = F.linear(F.rms_norm(x, x.shape[-1:], attn_norm, EPS), wqkv).view(t, heads + 2 * kv_heads, hd)
    qk = rope(qkv[:, : heads + kv_heads], cos, sin)  # [T, H + KV, hd]: queries and keys in one go
    # Query head h reads key/value head h // G. Folding each group's G heads into the query rows
    # lets every group attend to its own cached keys as they are, without repeating them G times.
    q = qk[:, :heads].reshape(t, kv_heads, group, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, group * t, hd)
    k = qk[:, heads:].transpose(0, 1)[None]  # [1, KV, T, hd]
    v = qkv[:, heads + kv_heads :].transpose(0, 1)[None]  # [1, KV, T, hd]
    k_cache.index_copy_(2, pos, k)
    v_cache.index_copy_(2, pos, v)
    attn = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask)  # [1, KV, G*T, hd]
    attn = attn.view(kv_heads, group, t, hd).permute(2, 0, 1, 3).reshape(t, heads * hd)  # [T, H*hd]
    x = x + F.linear(attn, wo)
    gate, up = F.linear(F.rms_norm(x, x.shape[-1:], mlp_norm, EPS), w13).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w2)


def group_mask(causal: torch.Tensor, pos: torch.Tensor, group: int) -> torch.Tensor:
    """[1, 1, G*T, L]: row g*T + i is query position pos[i]'s causal row, for each of the G heads."""
    return causal[pos].repeat(group, 1)[None, None]


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, H, hd] with cos/sin [T, hd/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def random_layer(shape: Shape, w: Callable, device, dtype) -> dict[str, torch.Tensor]:
    s, hd = shape, shape.head_dim
    return dict(
        attn_norm=torch.ones(s.dim, device=device, dtype=dtype),
        wqkv=w((s.heads + 2 * s.kv_heads) * hd, s.dim),
        wo=w(s.dim, s.heads * hd),
        mlp_norm=torch.ones(s.dim, device=device, dtype=dtype),
        w13=w(2 * s.ffn, s.dim),
        w2=w(s.dim, s.ffn),
    )


class Llama:
    """Decoder-only Llama with a static KV cache: forward(tokens [T], pos [T]) -> logits [T, V]."""

    def __init__(self, shape: Shape, max_len: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*size, std=0.02):
            return torch.randn(*size, generator=g, device=device, dtype=dtype) * std

        s, hd = shape, shape.head_dim
        self.shape, self.device, self.max_len = shape, device, max_len
        self.w = w
        self.embed = w(s.vocab, s.dim)
        self.layers = [random_layer(s, w, device, dtype) for _ in range(s.layers)]
        self.norm = torch.ones(s.dim, device=device, dtype=dtype)
        self.output = w(s.vocab, s.dim, std=1.0)  # peaked logits: argmax robust to rounding
        # One allocation per layer, so a compiled layer sees the same kind of input every time.
        self.k_caches = [torch.zeros(1, s.kv_heads, max_len, hd, device=device, dtype=dtype) for _ in range(s.layers)]
        self.v_caches = [torch.zeros_like(c) for c in self.k_caches]
        freqs = 1.0 / s.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd)
        angles = torch.outer(torch.arange(max_len, device=device).float(), freqs)  # [max_len, hd/2]
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)
        self.causal = torch.ones(max_len, max_len, dtype=torch.bool, device=device).tril()

    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm, self.output] + [t for lw in self.layers for t in lw.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, layer: Callable = decoder_layer) -> torch.Tensor:
        x = self.embed[tokens]  # [T, D]
        mask = group_mask(self.causal, pos, self.shape.heads // self.shape.kv_heads)  # a query sees positions <= its own
        cos, sin = self.cos[pos], self.sin[pos]  # [T, hd/2]
        for lw, k_cache, v_cache in zip(self.layers, self.k_caches, self.v_caches):
            x = layer(x, pos, mask, cos, sin, k_cache, v_cache, **lw,
                      heads=self.shape.heads, kv_heads=self.shape.kv_heads)
        return F.linear(F.rms_norm(x, x.shape[-1:], self.norm, EPS), self.output)  # [T, V]


class EagleShapedHead:
    """The draft step of an EAGLE-1 head for the target's shape (random weights: only its cost is
    measured): fc over [embedding; feature], one decoder layer with its own KV cache, the target's
    final norm and the first `draft_vocab` rows of its LM head (a reduced draft vocabulary)."""

    def __init__(self, target: Llama, draft_vocab: int):
        s, hd, dtype = target.shape, target.shape.head_dim, target.embed.dtype
        self.target, self.draft_vocab = target, draft_vocab
        self.fc = target.w(s.dim, 2 * s.dim)
        self.layer = random_layer(s, target.w, target.device, dtype)
        self.k_cache = torch.zeros(1, s.kv_heads, target.max_len, hd, device=target.device, dtype=dtype)
        self.v_cache = torch.zeros_like(self.k_cache)

    def forward(self, token: torch.Tensor, feature: torch.Tensor, pos: torch.Tensor, layer: Callable = decoder_layer):
        t = self.target  # token [T], feature [T, D] -> (draft tokens [T], next features [T, D])
        x = F.linear(torch.cat([t.embed[token], feature], dim=-1), self.fc)
        x = layer(x, pos, group_mask(t.causal, pos, t.shape.heads // t.shape.kv_heads), t.cos[pos], t.sin[pos], self.k_cache, self.v_cache,
                  **self.layer, heads=t.shape.heads, kv_heads=t.shape.kv_heads)
        logits = F.linear(F.rms_norm(x, x.shape[-1:], t.norm, EPS), t.output[: self.draft_vocab])
        return logits.argmax(-1), x


def capture(fn: Callable, inputs: tuple[torch.Tensor, ...], pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """fn(*inputs) recorded as a CUDA graph: replay() reruns it on whatever the static inputs hold."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up: allocator, cuBLAS handles, compilation
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*inputs)
    return graph, out


class Stepper:
    """Greedy next tokens for a block of T tokens starting at position `start`.

    With graphs, each block size is captured once (static token/position inputs, argmax output) and
    replayed; the only host work per step is two small copies in and one out.
    """

    def __init__(self, model: Llama, graphs: bool, layer: Callable = decoder_layer):
        self.model, self.graphs, self.layer = model, graphs, layer
        self.device = model.device
        self.captured: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if graphs else None

    @torch.inference_mode()
    def __call__(self, tokens: list[int], start: int) -> list[int]:
        t = len(tokens)
        tok = torch.tensor(tokens, dtype=torch.long)
        pos = torch.arange(start, start + t)
        if not self.graphs:
            return self.model.forward(tok.to(self.device), pos.to(self.device), self.layer).argmax(-1).tolist()
        if t not in self.captured:
            # Warm-up and capture write keys/values at `start`'s slots, which this replay rewrites.
            tok_in, pos_in = tok.to(self.device), pos.to(self.device)
            graph, out = capture(lambda a, b: self.model.forward(a, b, self.layer).argmax(-1), (tok_in, pos_in), self.pool)
            self.captured[t] = (graph, tok_in, pos_in, out)
        graph, tok_in, pos_in, out = self.captured[t]
        tok_in.copy_(tok, non_blocking=True)
        pos_in.copy_(pos, non_blocking=True)
        graph.replay()
        return out.tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(model: Llama, prompt: list[int]) -> None:
    model.forward(torch.tensor(prompt[:-1], device=model.device), torch.arange(len(prompt) - 1, device=model.device))


def greedy_continuation(step: Stepper, ids: list[int], n: int) -> list[int]:
    """ids + n greedy tokens, one at a time; positions before len(ids) - 1 must be cached already."""
    ids = list(ids)
    for _ in range(n):
        ids.append(step([ids[-1]], len(ids) - 1)[0])
    return ids


def plain_decode(step: Stepper, prompt: list[int], n: int) -> tuple[list[int], float]:
    """prompt + n greedy tokens, and tokens/s (prefill of prompt[:-1] excluded)."""
    prefill(step.model, prompt)
    sync(step.device)
    start = time.perf_counter()
    ids = greedy_continuation(step, prompt, n)
    sync(step.device)
    return ids, n / (time.perf_counter() - start)


@dataclass(frozen=True)
class SpecRun:
    ids: list[int]
    tokens_per_s: float
    tokens_per_step: float
    acceptance: float  # accepted drafts / (accepted + rejected) draft positions
    reanchors: int


def speculative_decode(step: Stepper, prompt: list[int], reference: list[int], n: int, k: int,
                       acceptance: float, seed: int) -> SpecRun:
    """Greedy chain speculation with the synthetic drafter, until at least n new tokens."""
    drafter = SyntheticDrafter(reference, acceptance, step.model.shape.vocab, seed=seed)
    params = SamplingParams()
    prefill(step.model, prompt)
    ids = list(prompt)
    steps = accepted = rejected = reanchors = 0
    untimed = 0.0
    sync(step.device)
    start = time.perf_counter()
    while len(ids) - len(prompt) < n:
        if drafter.reference[: len(ids)] != ids:
            # Rounding took the target off the reference: follow the target's own greedy path.
            t0 = time.perf_counter()
            drafter.reference = greedy_continuation(step, ids, n + k + 1 - (len(ids) - len(prompt)))
            sync(step.device)
            untimed += time.perf_counter() - t0
            reanchors += 1
        draft = drafter.propose(ids, k, params, None).tokens.tolist()
        target = step([ids[-1]] + draft, len(ids) - 1)  # argmax after each block position
        n_ok = next((i for i, (d, t) in enumerate(zip(draft, target)) if d != t), len(draft))
        ids += draft[:n_ok] + [target[n_ok]]  # stale cache slots past here are masked, then rewritten
        steps += 1
        accepted += n_ok
        rejected += n_ok < len(draft)
    sync(step.device)
    seconds = time.perf_counter() - start - untimed
    new = len(ids) - len(prompt)
    return SpecRun(ids, new / seconds, new / steps, accepted / max(accepted + rejected, 1), reanchors)


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of fn() over reps calls, after one untimed call."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float | None:
    """Bytes/s moved (read + written) by a device-to-device copy; None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    seconds = timed(lambda: b.copy_(a), device, 10)
    return 2 * a.numel() / seconds


def head_step_cost(model: Llama, draft_vocab: int, graphs: bool, layer: Callable, reps: int, pool) -> float:
    """Seconds per single-token EAGLE-shaped draft step (graph-captured on CUDA)."""
    head = EagleShapedHead(model, draft_vocab)
    token = torch.zeros(1, dtype=torch.long, device=model.device)
    feature = torch.zeros(1, model.shape.dim, dtype=model.embed.dtype, device=model.device)
    pos = torch.full((1,), model.max_len // 2, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        if graphs:
            graph, _ = capture(lambda a, b, c: head.forward(a, b, c, layer), (token, feature, pos), pool)
            return timed(graph.replay, model.device, reps)
        return timed(lambda: head.forward(token, feature, pos, layer)[0].cpu(), model.device, reps)


def compile_layer() -> Callable:
    import torch._dynamo

    config = torch._dynamo.config
    setattr(config, "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit", 32)
    return torch.compile(decoder_layer, fullgraph=True, dynamic=False)


def section(title: str, body: Callable[[], None]) -> bool:
    """Runs one part of the report; a failure is printed and the next part still runs."""
    print(f"\n## {title}", flush=True)
    try:
        body()
        return True
    except Exception:  # a measurement script: report and go on
        traceback.print_exc(file=sys.stdout)
        print(f"(section failed: {title})", flush=True)
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape, float32: checks the script runs")
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="datasheet bandwidth, bytes/s (H200: 4.8e12)")
    parser.add_argument("--context", type=int, default=512, help="prompt length (random ids)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--max-block", type=int, default=64)
    parser.add_argument("--no-graphs", action="store_true", help="no CUDA graphs")
    parser.add_argument("--compile", choices=("auto", "yes", "no"), default="auto",
                        help="also run with a torch.compile'd decoder layer (auto: on CUDA)")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --tiny --device cpu to check the script", file=sys.stderr)
        return 2
    shape = TINY if args.tiny else LLAMA_31_8B
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    context, new, max_block = (64, 32, 16) if args.tiny else (args.context, args.new_tokens, args.max_block)
    max_len = context + 2 * (new + max_block) + 8
    graphs = device.type == "cuda" and not args.no_graphs
    use_compile = args.compile == "yes" or (args.compile == "auto" and device.type == "cuda")
    reps = 5 if args.tiny else 20
    ks, accepts = (4, 8), (0.6, 0.8, 0.9)

    t_start = time.perf_counter()
    model = Llama(shape, max_len, device, dtype)
    sync(device)
    weight_bytes = model.weight_bytes()
    name = "tiny" if args.tiny else "Llama-3.1-8B shape"
    print(f"{name}: {weight_bytes / 1e9:.2f} GB of {str(dtype).removeprefix('torch.')} weights on {device}"
          + (f" ({torch.cuda.get_device_name(device)}, torch {torch.__version__})" if device.type == "cuda" else "")
          + f", built in {time.perf_counter() - t_start:.1f} s; context {context}, {new} new tokens", flush=True)
    measured_bw = copy_bandwidth(device)
    limits = {"datasheet": args.bandwidth / weight_bytes}
    print(f"bandwidth limit (datasheet {args.bandwidth / 1e12:.1f} TB/s): {limits['datasheet']:.0f} tok/s")
    if measured_bw:
        limits["measured copy"] = measured_bw / weight_bytes
        print(f"bandwidth limit (measured device copy {measured_bw / 1e12:.2f} TB/s): {limits['measured copy']:.0f} tok/s")

    prompt = torch.randint(0, shape.vocab, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    steppers = {"eager": Stepper(model, graphs=False)}
    if graphs:
        steppers["cuda graph"] = Stepper(model, graphs=True)
    if use_compile:
        steppers["cuda graph + compiled layer" if graphs else "compiled layer"] = Stepper(model, graphs, compile_layer())
    rates: dict[str, float] = {}
    references: dict[str, list[int]] = {}

    def plain() -> None:
        for label, step in list(steppers.items()):
            try:
                plain_decode(step, prompt, 4)  # warm-up (graph capture, compilation)
                ids, rate = plain_decode(step, prompt, new + max_block)
            except Exception:
                traceback.print_exc(file=sys.stdout)
                print(f"{label:>28}: failed; dropped from the rest of the run", flush=True)
                del steppers[label]
                continue
            rates[label], references[label] = rate, ids
            agree = sum(a == b for a, b in zip(ids, references["eager"])) / len(ids)
            shares = ", ".join(f"{rate / limit:.1%} of the {kind} limit" for kind, limit in limits.items())
            print(f"{label:>28}: {rate:8.1f} tok/s = {shares}"
                  + (f" (tokens equal to eager: {agree:.1%})" if label != "eager" else ""), flush=True)

    section("plain greedy decoding", plain)
    best = max(rates, key=rates.get) if rates else "eager"
    fastest = steppers[best]
    verify: dict[str, dict[int, float]] = {}

    def block_cost(step: Stepper, t: int) -> float:
        return timed(lambda: step([1] * t, context), device, reps)

    def curve() -> None:
        label = "cuda graph" if "cuda graph" in steppers else best
        print(f"one forward of T tokens at position {context} ({label}), relative to T = 1")
        cells, costs = [], verify.setdefault(label, {})
        for t in range(1, max_block + 1):
            costs[t] = block_cost(steppers[label], t)
            cells.append(f"T={t}: {costs[t] * 1e3:.2f} ms ({costs[t] / costs[1]:.2f}x)")
        for i in range(0, len(cells), 4):
            print("  " + "   ".join(cells[i : i + 4]))
        if best != label:
            costs = verify.setdefault(best, {})
            for t in (1,) + tuple(k + 1 for k in ks):
                costs[t] = block_cost(fastest, t)
            print(f"{best}: " + "   ".join(f"T={t}: {s * 1e3:.2f} ms ({s / costs[1]:.2f}x)" for t, s in costs.items()))

    section("verify cost", curve)

    def draft_cost() -> None:
        t1 = verify.get(best, {}).get(1) or block_cost(fastest, 1)
        layer = fastest.layer
        for draft_vocab in sorted({shape.vocab, min(32_768, shape.vocab)}, reverse=True):
            seconds = head_step_cost(model, draft_vocab, fastest.graphs, layer, reps, fastest.pool)
            c = seconds / t1
            a, k = 0.8, 4
            expected = (1 - a ** (k + 1)) / (1 - a)
            v = verify.get(best, {}).get(k + 1, t1) / t1 - 1
            print(f"EAGLE-shaped head, draft vocabulary {draft_vocab}: {seconds * 1e3:.3f} ms per draft step,"
                  f" c = {c:.3f} of a target step; at a = {a}, K = {k}: E / (1 + cK + v) = "
                  f"{expected / (1 + c * k + v):.2f}x", flush=True)

    section(f"draft step cost ({best})", draft_cost)

    def speculative() -> None:
        plain_ids, plain_rate = plain_decode(fastest, prompt, new)
        reference = references.get(best, plain_ids)
        print(f"{best}; plain, same mode: {plain_rate:.1f} tok/s")
        print(f"{'a':>5} {'K':>3} {'tok/s':>9} {'speedup':>8} {'tok/step':>9} {'E':>6} {'E/(1+v)':>8}"
              f" {'of ceiling':>10} {'measured a':>11} {'re-anchored':>12}")
        for k in ks:
            for a in accepts:
                speculative_decode(fastest, prompt, reference, 8, k, a, seed=0)  # capture the K+1 graph
                run = speculative_decode(fastest, prompt, reference, new, k, a, seed=1)
                expected = (1 - a ** (k + 1)) / (1 - a)
                costs = verify.get(best, {})
                v = costs[k + 1] / costs[1] - 1 if k + 1 in costs and 1 in costs else 0.0
                ceiling = expected / (1 + v)
                speedup = run.tokens_per_s / plain_rate
                print(f"{a:5.1f} {k:3d} {run.tokens_per_s:9.1f} {speedup:7.2f}x {run.tokens_per_step:9.2f}"
                      f" {expected:6.2f} {ceiling:7.2f}x {speedup / ceiling:10.1%} {run.acceptance:11.2f}"
                      f" {run.reanchors:12d}", flush=True)

    section("speculative decoding, synthetic drafter", speculative)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
