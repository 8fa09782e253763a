"""Which head trees pay on a CPU now that verification is cheap (integer kernels): the EAGLE methods at
tree budgets and CPU_STEP_ROWS cuts (engine/session.py), in one process, one `speclens bench` run per
setting on the same prompts, each beside plain decoding (`ar`). The target is loaded once.

    .venv/bin/python benchmarks/integer/sweep_tree_cut.py --num-prompts 24 --json benchmarks/integer/sweep-tree-cut.json

A setting is "budget/rows": a tree of `budget` nodes cut to the nodes worth verifying at `rows` rows
besides them, or "budget/whole" (no cut, as an asked budget runs)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from speclens.engine import session
from speclens.engine.runtime.models import LoadOptions, load_model
from speclens.engine.tools.bench import BenchOptions, load_prompts, run_bench


def engine_for(target, heads, budget: int, rows: float | None) -> session.Engine:
    """An Engine on the loaded target whose head trees hold `budget` nodes, cut at `rows` (None: whole)."""
    session.CPU_STEP_ROWS = rows if rows is not None else session.CPU_STEP_ROWS
    original = session.tree_budget
    session.tree_budget = lambda device, asked=None: budget
    try:
        engine = session.Engine(target, None, heads, None if rows is not None else budget)
    finally:
        session.tree_budget = original
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", default="../shared/data/spec-bench/question_dev.jsonl")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--settings", default="4/4,8/4,8/8,8/16,12/12,16/16,16/32,8/whole")
    parser.add_argument("--methods", default="eagle,eagle_lookup")
    parser.add_argument("--cpu-kernels", default="integer")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_model("default", LoadOptions(cpu_kernels=args.cpu_kernels))
    heads = tuple(str(session.SHIPPED_HEADS / name) for name in session.DEFAULT_HEADS
                  if (session.SHIPPED_HEADS / name).exists())
    prompts = load_prompts(args.prompts)
    methods = tuple(args.methods.split(","))
    rows_default = session.CPU_STEP_ROWS
    results = {}
    for setting in args.settings.split(","):
        budget, rows = setting.split("/")
        engine = engine_for(target, heads, int(budget), None if rows == "whole" else float(rows))
        report = run_bench(engine, prompts, BenchOptions(methods=methods, num_prompts=args.num_prompts,
                                                         max_new_tokens=args.max_new_tokens))
        session.CPU_STEP_ROWS = rows_default
        line = {m: {"speedup_vs_ar": r.speedup_vs_ar, "tau": r.tau, "equal_to_ar": r.equal_to_ar,
                    "tokens_per_s": r.tokens_per_s} for m, r in report.methods.items()}
        results[setting] = line
        print(setting, "  ".join(f"{m} {r['speedup_vs_ar']:.2f}x tau {r['tau'] or 0:.2f}"
                                 f"{'' if r['equal_to_ar'] in (True, None) else ' NOT EQUAL'}"
                                 for m, r in line.items()), flush=True)
        if args.json:  # after every setting: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "device": report.device,
                                                   "num_prompts": args.num_prompts, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
