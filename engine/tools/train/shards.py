"""Distilled training data as committed shards of token ids: the part of a distillation worth keeping.

A drafter learns from the target's own answers. The answers cost hours of CPU (or a borrowed GPU) to
make; the target's hidden states over them cost one batched prefill to recompute. So a shard keeps
only token ids (prompt + answer, uint16 where the vocabulary fits) with, per sequence, where the
answer starts and the temperature it was sampled at (0 = greedy), and in its metadata the target,
the run and the command that made it. Shards are safetensors files (no pickle), at most
MAX_SHARD_BYTES each, so they can be committed. Training reads every shard of a folder.

One file per (run, part): a rerun of the same run rewrites its own parts with a superset of what
they held; a shard of another run is never touched.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "speclens-distilled-1"
MAX_SHARD_BYTES = 16 * 2**20  # under the repository's 20 MB per file, with room for the index arrays


@dataclass(frozen=True)
class DistilledSequence:
    tokens: tuple[int, ...]  # prompt (chat template applied) + the target's answer
    answer_start: int  # index of the answer's first token in `tokens`
    temperature: float  # 0.0: greedy; else the temperature it was sampled at (top-k 0, top-p 1)

    @property
    def answer_tokens(self) -> int:
        return len(self.tokens) - self.answer_start


def run_id(facts: dict) -> str:
    """A short stable name for one distillation run (its target, prompts and settings)."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:12]


def write_shards(folder: str | Path, sequences: Sequence[DistilledSequence], run: str, meta: dict[str, str],
                 max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write `sequences` as folder/<run>-<part>.safetensors, each at most `max_bytes` of tokens."""
    from safetensors.numpy import save_file

    if not run or any(c not in "0123456789abcdefghijklmnopqrstuvwxyz-_" for c in run):
        raise ValueError(f"run name {run!r}: use lower-case letters, digits, '-' and '_'")
    biggest = max((max(s.tokens) for s in sequences if s.tokens), default=0)
    dtype = np.uint16 if biggest < 2**16 else np.uint32
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths, part, start = [], 0, 0
    while start < len(sequences):
        end, size = start, 0
        while end < len(sequences) and (end == start or size + len(sequences[end].tokens) * dtype().itemsize <= max_bytes):
            size += len(sequences[end].tokens) * dtype().itemsize
            end += 1
        chunk = sequences[start:end]
        lengths = np.array([len(s.tokens) for s in chunk], dtype=np.int64)
        tensors = {
            "tokens": np.concatenate([np.asarray(s.tokens, dtype=dtype) for s in chunk]),  # [N]
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),  # [S + 1]
            "answer_start": np.array([s.answer_start for s in chunk], dtype=np.int32),  # [S]
            "temperature": np.array([s.temperature for s in chunk], dtype=np.float64),  # [S]
        }
        path = folder / f"{run}-{part:04d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata={"format": FORMAT, "run": run, **meta})
        tmp.replace(path)  # a killed write leaves the previous file whole
        paths.append(path)
        part, start = part + 1, end
    for stale in folder.glob(f"{run}-*.safetensors"):  # a rerun that now needs fewer parts
        if stale not in paths and stale.stem.rsplit("-", 1)[-1].isdigit():
            stale.unlink()
    return paths


def read_shard(path: str | Path) -> tuple[list[DistilledSequence], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a SpecLens distilled-data shard (format {meta.get('format')!r})")
        tokens, offsets = f.get_tensor("tokens"), f.get_tensor("offsets")
        starts, temps = f.get_tensor("answer_start"), f.get_tensor("temperature")
    if len(offsets) != len(starts) + 1 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise ValueError(f"{path}: damaged shard (offsets do not match the tokens)")
    sequences = [DistilledSequence(tuple(int(t) for t in tokens[offsets[i]:offsets[i + 1]]), int(starts[i]),
                                   float(temps[i])) for i in range(len(starts))]
    return sequences, meta


def shard_paths(folders: Iterable[str | Path]) -> list[Path]:
    return sorted(p for folder in folders for p in Path(folder).glob("*.safetensors"))


def read_all(folders: Iterable[str | Path], target: str | None = None,
             skip_run: str = "") -> tuple[list[DistilledSequence], list[dict[str, str]]]:
    """Every sequence of every shard in `folders` (of `target`, when given), but those of run `skip_run`."""
    sequences, metas = [], []
    for path in shard_paths(folders):
        rows, meta = read_shard(path)
        if meta.get("run") == skip_run or (target is not None and meta.get("target") != target):
            continue
        sequences += rows
        metas.append({"file": path.name, **meta, "sequences": str(len(rows))})
    return sequences, metas


def summary(metas: Sequence[dict[str, str]], sequences: Sequence[DistilledSequence]) -> str:
    """One line for a model card: how much data, from how many runs."""
    runs = sorted({m.get("run", "") for m in metas})
    answer = sum(s.answer_tokens for s in sequences)
    return (f"{len(sequences)} sequences ({sum(len(s.tokens) for s in sequences)} tokens, {answer} answer tokens) "
            f"from {len(runs)} distillation run(s) in {len(metas)} shard(s)")
