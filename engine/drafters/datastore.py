"""Retrieval drafting (REST, He et al. 2024) from a datastore of the target's own answers.

Prompt lookup copies from the current context; a datastore extends the same idea to everything the
target has answered before. A small instruct model answers in set phrases ("Here are some tips",
"In conclusion,", list markup), so the tokens that followed the context's tail in its earlier answers
are a good guess at what follows now, at no model cost.

The index: every position of the stored token stream is keyed by the n-gram starting there, packed
into one int64 (ngram tokens of `bits` bits each, first token highest), and the positions are sorted
by key. The positions whose n-gram starts with a tail of m <= ngram tokens then form one contiguous
run of the sorted keys, found with two binary searches. Drafting takes the longest tail with a match
and builds the most frequent continuation token by token among the matches that agree so far.
Drafts are deterministic, so exactness does not depend on the datastore: a poor one only wastes
verification rows.

Folder layout: config.json ({"speclens_datastore": 1, "target": ..., "sequences": ..., "tokens": ...})
and datastore.safetensors with one int32 tensor "tokens" [L]: the stored sequences, each followed by -1.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from speclens.engine.decoding.drafter import Draft, StatelessDrafter
from speclens.engine.decoding.sampling import SamplingParams

END = -1  # separates stored sequences; no continuation runs across it
MAX_MATCHES = 512  # continuations counted per draft (an evenly spaced sample of a frequent tail's matches)
# How often the shipped store's chain was right through each depth, by the length of the tail it matched
# (see LOOKUP_ACCEPTANCE in engine/drafters/lookup.py: measured the same way, 600-880 chains per n).
STORE_ACCEPTANCE: dict[int, tuple[float, ...]] = {1: (0.14, 0.03, 0.0), 2: (0.21, 0.07, 0.03), 3: (0.38, 0.15, 0.09)}
# Grafted beside a head's tree (engine.tree.LookupGraftedDrafter), a chain's own nodes are those the head
# did not draft, and the head learned from the same answers the store holds: on the same 20 prompts,
# such nodes of the shipped store beside the shipped EAGLE head's 4-node tree were accepted 0.038 of the
# time where the table promised 0.141 (914 nodes), so there they are worth this share of the table.
STORE_BESIDE_A_TREE = 0.27
# The most a store chain's node is worth beside a tree: a cut that keeps nothing this cheap need not look it up.
STORE_BEST_BESIDE_A_TREE = STORE_BESIDE_A_TREE * max(row[0] for row in STORE_ACCEPTANCE.values())


class Datastore:
    def __init__(self, tokens: torch.Tensor):
        """tokens: [L] int, the stored sequences each followed by END."""
        self.tokens = tokens.to(torch.long)  # [L]
        if not bool((self.tokens > END).any()):
            raise ValueError("a datastore needs at least one stored token")
        self.max_token = int(self.tokens.max())
        # keys hold ids + 1, so that 0 can stand for END and for the padding past the stream's end
        self.bits = (self.max_token + 1).bit_length()
        self.ngram = max(1, 63 // self.bits)  # tokens per key: an int64 key stays non-negative
        stream = torch.cat([self.tokens + 1, torch.zeros(self.ngram, dtype=torch.long)])  # [L + ngram]
        length = self.tokens.numel()
        keys = torch.zeros(length, dtype=torch.long)  # [L]: the n-gram starting at each position
        for j in range(self.ngram):
            keys = (keys << self.bits) | stream[j : j + length]
        self.keys, self.positions = keys.sort(stable=True)  # [L], [L]; equal keys keep stream order
        self.stream = stream

    @classmethod
    def build(cls, sequences: Sequence[Sequence[int]]) -> Datastore:
        flat: list[int] = []
        for seq in sequences:
            flat += [*seq, END]
        return cls(torch.tensor(flat, dtype=torch.long))

    @property
    def sequences(self) -> int:
        return int((self.tokens == END).sum())

    def continuation(self, ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens: the most frequent continuation, in the store, of the longest tail of ids
        (at most `ngram` tokens) that occurs there with a continuation."""
        return self.continuation_match(ids, k)[0]

    def continuation_match(self, ids: Sequence[int], k: int) -> tuple[list[int], int]:
        """continuation's chain and the length n of the tail it matched (0: none)."""
        if k <= 0 or not ids:
            return [], 0
        for n in range(min(self.ngram, len(ids)), 0, -1):
            prefix = self._packed(ids[-n:])
            if prefix is None:
                continue
            # the keys starting with these n tokens: [prefix, prefix with every later bit set]
            shift = self.bits * (self.ngram - n)
            low, high = prefix << shift, (prefix << shift) | ((1 << shift) - 1)
            lo = int(torch.searchsorted(self.keys, torch.tensor(low)))
            hi = int(torch.searchsorted(self.keys, torch.tensor(high), right=True))
            if hi > lo:
                step = -(-(hi - lo) // MAX_MATCHES)  # ceil: at most MAX_MATCHES evenly spaced matches
                chain = self._most_frequent(self.positions[lo:hi:step] + n, k)
                if chain:
                    return chain, n
        return [], 0

    def _packed(self, tail: Sequence[int]) -> int | None:
        """The key bits of a tail of token ids; None if an id is too wide to be in this store."""
        prefix = 0
        for token in tail:
            if not 0 <= token <= self.max_token:
                return None
            prefix = (prefix << self.bits) | (token + 1)
        return prefix

    def _most_frequent(self, starts: torch.Tensor, k: int) -> list[int]:
        """starts: [M] positions right after each match; the chain of most frequent next tokens."""
        offsets = torch.arange(k)
        follow = self.stream[(starts[:, None] + offsets).clamp(max=self.stream.numel() - 1)]  # [M, k], 0 = ended
        chain: list[int] = []
        for depth in range(k):
            column = follow[:, depth]  # [M']
            column = column[column > 0]
            if column.numel() == 0:
                break
            values, counts = column.unique(return_counts=True)
            best = int(values[counts.argmax()])
            chain.append(best - 1)
            follow = follow[follow[:, depth] == best]
        return chain

    def save(self, folder: str | Path, **info) -> None:
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": self.tokens.to(torch.int32)}, folder / "datastore.safetensors")
        config = {"speclens_datastore": 1, "sequences": self.sequences, "tokens": int(self.tokens.numel()), **info}
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> Datastore:
        from safetensors.torch import load_file

        tokens = load_file(Path(folder) / "datastore.safetensors")["tokens"]
        if tokens.dim() != 1 or tokens.numel() == 0 or int(tokens.min()) < END:
            raise ValueError("datastore.safetensors must hold a 1-D 'tokens' tensor of ids and -1 separators")
        return cls(tokens)  # raises ValueError if it holds no token


def is_datastore(config: dict) -> bool:
    return "speclens_datastore" in config


class DatastoreDrafter(StatelessDrafter):
    """Linear drafting from a datastore alone (method `rest`)."""

    name = "rest"

    def __init__(self, store: Datastore):
        self.store = store

    def propose(
        self, ids: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        return Draft(tokens=torch.tensor(self.store.continuation(ids, k), dtype=torch.long), probs=None)
