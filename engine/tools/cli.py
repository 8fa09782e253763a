"""Command line: `speclens generate | bench | selftest | doctor | train-drafter` (speclens.app.launcher
opens the window when no subcommand is given)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace

from speclens.engine.decoding.limits import (
    DRAFT_MODEL_METHODS,
    OVERFLOW_POLICIES,
    SettingError,
    check_int,
    check_method,
)
from speclens.engine.decoding.prompt import clean_text, decode_bytes, replaced_warning
from speclens.engine.tools.args import (
    add_model_arguments,
    add_sampling_arguments,
    load_engine,
    model_settings,
    stderr_progress,
)

SUBCOMMANDS = ("generate", "bench", "selftest", "doctor", "train-drafter")

ANSI = {
    "draft_accepted": "\x1b[32m",  # green
    "target_resampled": "\x1b[31m",  # red
    "bonus": "\x1b[34m",  # blue
    "target": "",
}
RESET = "\x1b[0m"


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
    gen.add_argument("--context-overflow", default="stop", choices=OVERFLOW_POLICIES,
                     help="a prompt that leaves the answer no room in the model's context: stop with a message, or "
                          "drop the oldest turns (with --chat; the system prompt stays) or tokens")

    st = sub.add_parser("selftest", help="statistical exactness tests and a greedy-equality check")
    add_model_arguments(st)
    st.add_argument("--trials", type=int, default=65_536)
    st.add_argument("--skip-model", action="store_true", help="only the verification functions")

    doctor = sub.add_parser("doctor", help="versions, devices, where models and settings live, which drafters fit")
    doctor.add_argument("--target", default="default",
                        help="the target whose drafters are checked: 'default' or a model folder (no download)")
    doctor.add_argument("--drafter", action="append", default=[], metavar="DIR",
                        help="also check this drafter folder against the target (repeatable)")

    bench = sub.add_parser("bench", help="benchmark methods side by side")
    from speclens.engine.tools.bench import add_bench_arguments

    add_model_arguments(bench)
    add_bench_arguments(bench)

    train = sub.add_parser("train-drafter", help="train EAGLE or Medusa heads, or build a retrieval datastore, "
                                                 "for a target (self-distillation)")
    from speclens.engine.tools.train.options import add_train_arguments

    add_train_arguments(train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The subcommands (the `speclens` command without one opens the window: speclens.app.launcher)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handler = {"generate": cmd_generate, "selftest": cmd_selftest, "doctor": cmd_doctor}.get(args.command)
    if args.command == "train-drafter":
        from speclens.engine.tools.train.run import cmd_train_drafter

        handler = cmd_train_drafter
    elif handler is None:
        from speclens.engine.tools.bench import cmd_bench

        handler = cmd_bench
    try:
        return handler(args)
    except SettingError as exc:  # raised by the configs' own checks, before any model loads
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def preflight_generate(args: argparse.Namespace):
    """The generation config of a `generate` command, and its model settings checked, before any model
    loads (the method, if named, is resolved to an available one after). SettingError otherwise."""
    from speclens.engine.decoding.decode import GenerationConfig
    from speclens.engine.decoding.sampling import SamplingParams

    if args.method is not None:
        check_method(args.method)
    if args.method in DRAFT_MODEL_METHODS and not args.draft:
        raise SettingError(f"--method {args.method} needs --draft MODEL")
    if args.system and not args.chat:
        raise SettingError("--system needs --chat (a system prompt is part of the chat template)")
    config = GenerationConfig(
        method=args.method or "ar", k=args.k, max_new_tokens=args.max_new_tokens, seed=args.seed,
        stop_strings=tuple(args.stop),
        sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.repetition_penalty),
    )
    model_settings(args)
    return config


def cmd_generate(args: argparse.Namespace) -> int:
    from speclens.engine.decoding.events import Summary, TokenEvent
    from speclens.engine.session import EngineError

    config = preflight_generate(args)  # a mistake costs no model load
    if args.prompt is not None:
        prompt, replaced = clean_text(args.prompt)
        where = "--prompt"
    else:
        stdin = getattr(sys.stdin, "buffer", None)  # bytes, so that the invalid-bytes policy is ours
        prompt, replaced = decode_bytes(stdin.read()) if stdin is not None else clean_text(sys.stdin.read())
        where = "standard input"
    if replaced:
        print(replaced_warning(replaced, where), file=sys.stderr)
    if not prompt.strip():
        print("error: the prompt is empty (give the text with --prompt or on standard input)", file=sys.stderr)
        return 2
    system, _ = clean_text(args.system)

    engine = load_engine(args)
    method = args.method or ("draft" if args.draft else engine.default_method)
    if method not in engine.methods:
        print(f"error: method {method!r} is not available; the loaded models offer {', '.join(engine.methods)}",
              file=sys.stderr)
        return 2
    config = replace(config, method=method)
    turns = [{"role": "system", "content": system}] if system else []
    try:
        if args.chat:
            fitted = engine.fit_chat([*turns, {"role": "user", "content": prompt}], config.max_new_tokens,
                                     args.context_overflow)
        else:
            fitted = engine.fit_text(prompt, config.max_new_tokens, args.context_overflow)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if fitted.notice:
        print(f"note: {fitted.notice}", file=sys.stderr)
    ids = list(fitted.ids)
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
            if event.stop_reason == "context_full":
                print(f"note: the model's context of {engine.context_length:,} tokens is full: the answer stops here",
                      file=sys.stderr)
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
    from speclens.engine.tools.selftest import run_selftest

    check_int("--trials", args.trials, 1, 100_000_000)
    engine = None if args.skip_model else load_engine(args)
    report = run_selftest(engine, trials=args.trials, progress=stderr_progress)
    for line in report.lines:
        print(line)
    print("self-test " + ("PASSED" if report.passed else "FAILED"))
    return 0 if report.passed else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from speclens.engine.tools.doctor import diagnose

    problems = 0
    for label, value, ok in diagnose(getattr(args, "target", "default"), tuple(getattr(args, "drafter", ()))):
        mark = "ok " if ok else "!! "
        problems += not ok
        print(f"{mark}{label}: {value}")
    return 0 if problems == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
