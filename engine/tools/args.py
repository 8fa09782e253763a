"""What the commands share: model and sampling arguments, progress on stderr, loading an Engine."""

from __future__ import annotations

import argparse
import sys


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
    parser.add_argument("--cpu-kernels", default="auto", choices=["auto", "integer", "integer16", "native", "packed", "stock"],
                        help="on CPU: auto runs float32 models on SpecLens's native kernels (compiled for this CPU at "
                             "first use), integer ones (8-bit activations against 4-bit/8-bit weight blocks) where they "
                             "pass their check, else packs linear weights for oneDNN and picks kernels by measurement; "
                             "integer insists on the integer kernels; integer16 runs them on 16-bit activations (two "
                             "8-bit passes: nearer float32, twice the integer work a row); native on the float32 native kernels (HF's "
                             "float32 numbers bit for bit); packed uses oneDNN for every block; stock keeps nn.Linear")
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


def stderr_progress(message: str, fraction: float | None) -> None:
    suffix = f" {fraction * 100:5.1f}%" if fraction is not None else ""
    print(f"\r{message}{suffix}", end="\n" if fraction in (None, 1.0) else "", file=sys.stderr, flush=True)


def model_settings(args: argparse.Namespace):
    """The model arguments as a checked ModelSettings (limits.SettingError: the command exits 2 before loading)."""
    from speclens.engine.session import ModelSettings

    return ModelSettings(args.target, args.draft, tuple(args.drafter), args.device, args.dtype,
                         args.trust_remote_code, args.offload, args.cpu_kernels, args.tree_budget)


def load_engine(args: argparse.Namespace):
    from speclens.engine.session import Engine, EngineError

    settings = model_settings(args)
    try:
        return Engine.load(settings, stderr_progress)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
