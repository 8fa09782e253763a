"""Token-tree topology as the runtime needs it: node depths (positions), ancestor paths and the
tree-attention mask. A tree is given by parent indices: node 0 is the root, parents[i] < i."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def node_depths(parents: Sequence[int]) -> list[int]:
    depths = [0] * len(parents)
    for node in range(1, len(parents)):
        depths[node] = depths[parents[node]] + 1
    return depths


def ancestor_path(parents: Sequence[int], node: int) -> list[int]:
    """Nodes from depth 1 down to `node` (the root excluded)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def tree_attention(parents: Sequence[int]) -> torch.Tensor:
    """[N, N] bool: row i is True at i and at every ancestor of i (what node i may attend to)."""
    n = len(parents)
    rows: list[list[bool]] = []  # Python lists: a torch op per node cost 5x as much
    for node in range(n):
        row = rows[parents[node]].copy() if node else [False] * n
        row[node] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).reshape(n, n)
