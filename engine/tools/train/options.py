"""What a training run is asked to do: TrainOptions, the prompt files, and the command line.

`command_line` writes the options back as the `speclens train-drafter` command that makes the same
run (with neutral paths), for model cards and shard metadata.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from speclens.engine.decoding.limits import MAX_K, MAX_TEMPERATURE, SettingError, check_choice, check_float, check_int

# The kinds --kind accepts: the trained heads (one module each, listed in registry.py) and the
# datastore, which stores answers and trains nothing. Kept here, not imported from the registry,
# so that parsing the command line stays free of the heads' modules.
KINDS = ("eagle", "eagle3", "dflash", "medusa", "datastore")

# The whole-number and real options and what each accepts (TrainOptions.__post_init__).
_INT_RANGES = (
    ("self_prompts", 0, 10_000_000), ("max_prompts", 1, 100_000_000), ("held_out", 0, 100_000),
    ("answer_tokens", 1, 32_768), ("sampled_answers", 0, 64), ("batch_size", 1, 65_536), ("epochs", 0, 10_000),
    ("tokens_per_step", 1, 10_000_000), ("unroll", 1, 16), ("draft_vocab", 0, 10_000_000), ("medusa_heads", 1, 16),
    ("medusa_layers", 1, 16), ("medusa_tree_nodes", 1, 1024), ("depth", 1, MAX_K), ("top_k", 1, 1024),
    ("budget", 1, 1024), ("chain", 1, MAX_K), ("eval_tokens", 0, 32_768), ("threads", 1, 1024), ("seed", 0, 2**63 - 1),
    ("max_shard_sequences", 0, 1_000_000_000), ("block_size", 2, 64), ("anchors", 1, 4096),
)
_FLOAT_RANGES = (("feature_noise", 0.0, 10.0), ("ce_weight", 0.0, 1000.0), ("distil_seconds", 0.0, 1e7))


@dataclass(frozen=True)
class TrainOptions:
    kind: str
    target: str
    prompts: tuple[str, ...]
    out: str
    data: str = ""  # distilled data file, shareable between EAGLE and Medusa runs; "" = OUT/distilled.pt
    extra_data: tuple[str, ...] = ()  # distilled files of other prompt sets (made with distil_only), trained on too
    # folders of committed token-id shards (engine.distilled): the run's own answers are written into
    # the first, and every shard of every folder is trained on (features recomputed by prefill)
    shards: tuple[str, ...] = ()
    distil_only: bool = False  # stop after distilling (to build an extra_data file)
    self_prompts: int = 0  # extra training prompts written by the target itself (Magpie), kept in OUT
    self_prompt_temperature: float = 1.0
    distil_dtype: str = "float32"  # the target copy that writes prompts and answers and gives the features
    max_prompts: int = 100_000
    held_out: int = 20  # prompts kept for the tau evaluation
    answer_tokens: int = 160  # length of the target's distilled answers
    sampled_answers: int = 0  # extra answers per prompt, sampled at sample_temperatures in turn
    sample_temperatures: tuple[float, ...] = (0.7,)  # answer v (1..sampled_answers) at [(v - 1) % len]
    batch_size: int = 32  # prompts per distillation batch
    epochs: int = 10
    lr: float = 6e-4  # peak; linear warm-up over 5% of the steps, then cosine decay to 10%
    tokens_per_step: int = 2048  # packed tokens per optimiser step
    feature_noise: float = 0.1  # EAGLE: uniform noise on input features, in units of their RMS
    ce_weight: float = 0.1  # EAGLE: weight of the cross-entropy term (the feature regression has weight 1)
    # EAGLE: drafting passes per training step (2+: later passes read the head's own features; a step
    # then costs about D(D+1)/2 times as much, with attention over D x tokens_per_step entries)
    unroll: int = 1
    init_from_target: bool = False  # EAGLE: the decoder layer starts as a copy of the target's last layer
    init_from: str = ""  # a trained head folder of this kind to start from (to continue on more data)
    # EAGLE, and Medusa heads sharing the target's LM head: draft only the N most frequent answer tokens (0: all)
    draft_vocab: int = 8192
    medusa_heads: int = 4
    medusa_layers: int = 1
    medusa_tree_nodes: int = 24  # Medusa: nodes of the sparse tree built from the heads' measured accuracy
    depth: int = 6  # EAGLE dynamic tree depth for the evaluation (Medusa: its number of heads)
    top_k: int = 8  # EAGLE dynamic tree: children per expanded node and nodes expanded per depth
    budget: int = 32  # EAGLE dynamic tree: nodes verified per step
    chain: int = 4  # EAGLE chain length for the evaluation
    eval_tokens: int = 128  # new tokens per held-out prompt when measuring tau (0: measure later, see evaluate_only)
    threads: int = 2
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"  # where distillation and training run (auto: a CUDA GPU if there is one, else the CPU)
    evaluate_only: bool = False  # measure tau of the head already in OUT and rewrite its card (no training)
    distil_seconds: float = 0.0  # stop distilling after this long (what is done is kept; 0: no limit)
    max_shard_sequences: int = 0  # train on at most this many of the shards' sequences, the first ones (0: all)
    block_size: int = 8  # DFlash: the block one forward fills (the known token and block_size - 1 masks)
    anchors: int = 4  # DFlash: blocks drawn per training sequence per step (more: more signal per feature prefill)

    def __post_init__(self) -> None:  # refused before any model loads, one line each (limits)
        check_choice("--kind", self.kind, KINDS)
        for name, low, high in _INT_RANGES:
            check_int(f"--{name.replace('_', '-')}", getattr(self, name), low, high)
        for name, low, high in _FLOAT_RANGES:
            check_float(f"--{name.replace('_', '-')}", getattr(self, name), low, high)
        check_float("--lr", self.lr, 0.0, 1.0, low_open=True)
        check_float("--self-prompt-temperature", self.self_prompt_temperature, 0.0, MAX_TEMPERATURE, low_open=True)
        for t in self.sample_temperatures:
            check_float("--sample-temperatures", t, 0.0, MAX_TEMPERATURE)
        if not self.sample_temperatures:
            raise SettingError("--sample-temperatures needs at least one temperature")

    @property
    def data_path(self) -> Path:
        return Path(self.data) if self.data else Path(self.out) / "distilled.pt"


def load_prompts(paths: tuple[str, ...]) -> list[str]:
    """Self-Instruct style .jsonl (instruction + the first instance's input) or one prompt a line, without duplicates."""
    prompts: list[str] = []
    for path in map(Path, paths):
        if "spec-bench" in path.resolve().parts:
            raise ValueError(f"{path}: benchmark prompts must not be used for training")
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                row = json.loads(line)
                text = row.get("instruction") or row.get("prompt") or row.get("text", "")
                inputs = [i.get("input", "") for i in row.get("instances", [])]
                if inputs and inputs[0].strip():
                    text = f"{text}\n\n{inputs[0].strip()}"
            else:
                text = line
            if text.strip():
                prompts.append(text.strip())
    return list(dict.fromkeys(prompts))  # a prompt listed twice (say, by two generator seeds) counts once


def split_prompts(prompts: list[str], options: TrainOptions) -> tuple[list[str], list[str]]:
    order = list(range(len(prompts)))
    random.Random(options.seed).shuffle(order)
    chosen = [prompts[i] for i in order[: options.max_prompts + options.held_out]]
    return chosen[options.held_out :], chosen[: options.held_out]


def neutral(options: TrainOptions) -> dict:
    """The options with every path cut to its last part (a card must not name this machine's folders)."""
    values = asdict(options)
    values["prompts"] = [Path(p).name for p in options.prompts]
    values["out"] = Path(options.out).name
    values["data"] = Path(options.data).name if options.data else ""
    values["extra_data"] = [Path(p).name for p in options.extra_data]
    values["shards"] = [Path(p).name for p in options.shards]
    values["init_from"] = Path(options.init_from).name if options.init_from else ""
    return values


def command_line(options: TrainOptions) -> str:
    """The `speclens train-drafter` command line of these options, with neutral paths."""
    defaults = asdict(TrainOptions(options.kind, options.target, (), ""))
    values = neutral(options)
    words = ["speclens train-drafter", f"--kind {options.kind}"]
    words += [f"--prompts data/self-instruct/{name}" for name in values["prompts"]]
    words += [f"--out {values['out']}"] + ([f"--data {values['data']}"] if options.data else [])
    words += [f"--extra-data {name}" for name in values["extra_data"]]
    words += [f"--shards data/distilled/{name}" for name in values["shards"]]
    for name, value in values.items():
        if name in ("kind", "prompts", "out", "data", "extra_data", "shards", "dtype", "evaluate_only") or value == defaults[name]:
            continue
        if name in ("init_from_target", "distil_only"):
            words.append(f"--{name.replace('_', '-')}")
        elif name == "sample_temperatures":
            words.append(f"--sample-temperatures {','.join(f'{t:g}' for t in value)}")
        else:
            words.append(f"--{name.replace('_', '-')} {value}")
    return " ".join(words)


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(t > 0 for t in values):
        raise argparse.ArgumentTypeError(f"give positive temperatures separated by commas, got {text!r}")
    return values


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--target", default="default")
    parser.add_argument("--prompts", action="append", required=True, help="a .jsonl or text file (repeatable)")
    parser.add_argument("--out", required=True, help="output folder (also holds resumable state)")
    parser.add_argument("--data", default="", help="distilled data file (default OUT/distilled.pt); "
                        "an EAGLE and a Medusa run with the same prompts can share it")
    defaults = TrainOptions("eagle", "", (), "")
    for name in ("max_prompts", "held_out", "answer_tokens", "sampled_answers", "batch_size", "epochs",
                 "tokens_per_step", "unroll", "draft_vocab", "medusa_heads", "medusa_layers", "medusa_tree_nodes", "depth", "top_k", "budget", "chain",
                 "eval_tokens", "threads", "seed", "block_size", "anchors"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--self-prompts", type=int, default=defaults.self_prompts, metavar="N",
                        help="also train on N user prompts the target writes itself (Magpie), kept in OUT/self-prompts.jsonl")
    parser.add_argument("--self-prompt-temperature", type=float, default=defaults.self_prompt_temperature)
    parser.add_argument("--sample-temperatures", type=_temperatures, default=defaults.sample_temperatures,
                        metavar="T[,T...]", help="temperatures of the --sampled-answers, in turn "
                        f"(default {','.join(f'{t:g}' for t in defaults.sample_temperatures)})")
    parser.add_argument("--distil-dtype", choices=("float32", "bfloat16"), default=defaults.distil_dtype,
                        help="dtype of the target copy that writes the prompts and answers and gives the features")
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--feature-noise", type=float, default=defaults.feature_noise)
    parser.add_argument("--ce-weight", type=float, default=defaults.ce_weight,
                        help="EAGLE: weight of the cross-entropy to the target's next-token distribution")
    parser.add_argument("--extra-data", action="append", default=[],
                        help="a distilled data file of other prompts (from a --distil-only run) to train on too (repeatable)")
    parser.add_argument("--shards", action="append", default=[], metavar="DIR",
                        help="folder of committed token-id shards (repeatable): this run's answers are written "
                             "into the first, and every shard found is trained on")
    parser.add_argument("--distil-seconds", type=float, default=defaults.distil_seconds, metavar="S",
                        help="stop distilling after S seconds, keeping every answer made (a GPU session's budget)")
    parser.add_argument("--max-shard-sequences", type=int, default=defaults.max_shard_sequences, metavar="N",
                        help="train on the shards' first N sequences only (0: all; a CPU's budget)")
    parser.add_argument("--distil-only", action="store_true",
                        help="stop after distilling the prompts into DATA (for --extra-data of another run)")
    parser.add_argument("--init-from", default="", metavar="DIR",
                        help="start from a trained head of the same kind (continue training it on more data)")
    parser.add_argument("--init-from-target", action="store_true",
                        help="EAGLE: start the decoder layer as a copy of the target's last layer")
    parser.add_argument("--device", default=defaults.device,
                        help="where to distil and train: auto (a CUDA GPU if there is one), cpu, cuda or cuda:N")
    parser.add_argument("--evaluate-only", action="store_true",
                        help="measure tau of the head a finished run left in OUT (e.g. trained on a GPU with "
                        "--eval-tokens 0) on this machine's CPU, on that run's held-out prompts, and rewrite its "
                        "card; give the run's --kind, --prompts and --out (its other options come from training.json)")
