"""Command line: `speclens generate | bench | selftest | doctor | train-drafter`; no subcommand opens the window."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

SUBCOMMANDS = ("generate", "bench", "selftest", "doctor", "train-drafter")

ANSI = {
    "draft_accepted": "\x1b[32m",  # green
    "target_resampled": "\x1b[31m",  # red
    "bonus": "\x1b[34m",  # blue
    "target": "",
}
RESET = "\x1b[0m"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default", help="'default', a model folder, a .gguf file or a hub id")
    parser.add_argument("--draft", default=None, help="draft model (folder, .gguf or hub id) for --method draft/tree")
    parser.add_argument("--drafter", action="append", default=[], metavar="DIR",
                        help="folder of trained EAGLE or Medusa heads or of a datastore (repeatable); "
                             "the default target ships its own")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--trust-remote-code", action="store_true", help="run model code from the model's repo")
    parser.add_argument("--offload", action="store_true",
                        help="spread a target too large for the GPU over GPU and CPU memory (accelerate device_map=auto)")
    parser.add_argument("--cpu-kernels", default="auto", choices=["auto", "native", "packed", "stock"],
                        help="on CPU: auto runs float32 models on SpecLens's native kernels (compiled for this CPU at "
                             "first use), else packs linear weights for oneDNN and picks one-token and block kernels by "
                             "measurement; native insists on the native kernels; packed uses oneDNN for every block; "
                             "stock keeps nn.Linear")
    parser.add_argument("--tree-budget", type=int, default=None, metavar="N",
                        help="draft-tree nodes for the EAGLE and Medusa methods, 1..128 (default: 4 on CPU, 32 on GPU)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-k", "--draft-length", dest="k", type=int, default=4, help="draft length K")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speclens", description="Exact speculative decoding, visible.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text, coloured by token provenance")
    add_model_arguments(gen)
    add_sampling_arguments(gen)
    gen.add_argument("--method", default=None,
                     help="ar (plain), lookup (prompt lookup), draft / tree (a --draft model), eagle / eagle_chain / "
                          "eagle_lookup / medusa (trained heads); default: the best the loaded models offer")
    gen.add_argument("--prompt", default=None, help="prompt text (default: read standard input)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", default="", help="with --chat: a system prompt before the user's turn")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--jsonl", action="store_true", help="one JSON object per token, then a summary")

    st = sub.add_parser("selftest", help="statistical exactness tests and a greedy-equality check")
    add_model_arguments(st)
    st.add_argument("--trials", type=int, default=65_536)
    st.add_argument("--skip-model", action="store_true", help="only the verification functions")

    sub.add_parser("doctor", help="versions, devices, where models and settings live")

    bench = sub.add_parser("bench", help="benchmark methods side by side")
    from engine.bench import add_bench_arguments

    add_model_arguments(bench)
    add_bench_arguments(bench)

    train = sub.add_parser("train-drafter", help="train EAGLE or Medusa heads, or build a retrieval datastore, "
                                                 "for a target (self-distillation)")
    from engine.train import add_train_arguments

    add_train_arguments(train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        from app.main import main as app_main  # the window; only reached without a subcommand

        return app_main(argv)
    args = build_parser().parse_args(argv)
    handler = {"generate": cmd_generate, "selftest": cmd_selftest, "doctor": cmd_doctor}.get(args.command)
    if args.command == "train-drafter":
        from engine.train import cmd_train_drafter

        handler = cmd_train_drafter
    elif handler is None:
        from engine.bench import cmd_bench

        handler = cmd_bench
    try:
        return handler(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def stderr_progress(message: str, fraction: float | None) -> None:
    suffix = f" {fraction * 100:5.1f}%" if fraction is not None else ""
    print(f"\r{message}{suffix}", end="\n" if fraction in (None, 1.0) else "", file=sys.stderr, flush=True)


def load_engine(args: argparse.Namespace):
    from engine.session import Engine, EngineError, ModelSettings

    settings = ModelSettings(args.target, args.draft, tuple(args.drafter), args.device, args.dtype,
                             args.trust_remote_code, args.offload, args.cpu_kernels, args.tree_budget)
    try:
        return Engine.load(settings, stderr_progress)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.decode import GenerationConfig
    from engine.events import Summary, TokenEvent
    from engine.sampling import SamplingParams
    from engine.session import EngineError

    if args.method in ("draft", "tree") and not args.draft:
        print(f"error: --method {args.method} needs --draft MODEL", file=sys.stderr)
        return 2
    if args.system and not args.chat:
        print("error: --system needs --chat (a system prompt is part of the chat template)", file=sys.stderr)
        return 2
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    engine = load_engine(args)
    method = args.method or ("draft" if args.draft else engine.default_method)
    if method not in engine.methods:
        print(f"error: method {method!r} is not available; the loaded models offer {', '.join(engine.methods)}",
              file=sys.stderr)
        return 2
    try:
        config = GenerationConfig(
            method=method, k=args.k, max_new_tokens=args.max_new_tokens, seed=args.seed,
            stop_strings=tuple(args.stop),
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system}] if args.system else []
    try:
        ids = engine.encode_chat([*system, {"role": "user", "content": prompt}]) if args.chat else engine.encode_text(prompt)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    colour = sys.stdout.isatty() or not args.jsonl
    for event in engine.generate_ids(ids, config):
        if isinstance(event, TokenEvent):
            if args.jsonl:
                print(json.dumps({"type": "token", "id": event.token_id, "text": event.text, "source": event.source,
                                  "step": event.step, "pos": event.pos, "p_target": event.p_target,
                                  "p_draft": event.p_draft, "proposer": event.proposer}), flush=True)
            elif event.text:
                start = ANSI[event.source] if colour else ""
                print(f"{start}{event.text}{RESET if start else ''}", end="", flush=True)
        elif isinstance(event, Summary):
            record = summary_record(event)
            if args.jsonl:
                print(json.dumps(record), flush=True)
            else:
                print()
                print_summary(record)
    return 0


def summary_record(summary) -> dict:
    return {
        "type": "summary",
        "method": summary.method,
        "new_tokens": summary.new_tokens,
        "steps": summary.steps,
        "drafted": summary.drafted,
        "accepted": summary.accepted,
        "acceptance_rate": summary.acceptance_rate,
        "mean_accepted_length": summary.mean_accepted_length,
        "per_position_acceptance": list(summary.per_position_acceptance),
        "accepted_length_histogram": list(summary.accepted_length_histogram),
        "accepted_by": dict(summary.accepted_by),
        "tokens_per_s": summary.tokens_per_s,
        "elapsed_s": summary.elapsed_s,
        "prefill_s": summary.prefill_s,
        "stop_reason": summary.stop_reason,
    }


def print_summary(record: dict) -> None:
    legend = "  ".join(f"{ANSI[s]}{s}{RESET}" if ANSI[s] else s for s in ANSI)
    per_pos = " ".join(f"{a:.2f}" for a in record["per_position_acceptance"]) or "-"
    by = ", ".join(f"{name} {n}" for name, n in record["accepted_by"].items())
    print(
        f"[{record['method']}] {record['new_tokens']} tokens in {record['steps']} steps, "
        f"{record['tokens_per_s']:.1f} tok/s; drafted {record['drafted']}, accepted {record['accepted']} "
        f"({record['acceptance_rate']:.0%}{'; by ' + by if by else ''}); tau {record['mean_accepted_length']:.2f}; "
        f"per position {per_pos}; stop: {record['stop_reason']}",
        file=sys.stderr,
    )
    print(f"legend: {legend}", file=sys.stderr)


def cmd_selftest(args: argparse.Namespace) -> int:
    from engine.selftest import run_selftest

    engine = None if args.skip_model else load_engine(args)
    report = run_selftest(engine, trials=args.trials, progress=stderr_progress)
    for line in report.lines:
        print(line)
    print("self-test " + ("PASSED" if report.passed else "FAILED"))
    return 0 if report.passed else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from engine.doctor import diagnose

    problems = 0
    for label, value, ok in diagnose():
        mark = "ok " if ok else "!! "
        problems += not ok
        print(f"{mark}{label}: {value}")
    return 0 if problems == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
