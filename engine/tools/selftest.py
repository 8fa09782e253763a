"""Statistical exactness checks of the verification functions, usable from tests, CLI and app.

For a chain step, the emitted token at block position j, among the trials that reached j (the first
j drafts accepted), must be distributed as target row j. The check runs many trials with draft
tokens sampled from the draft rows and compares the counts with the target: every count within
6 sigma + 5 of its expectation and a chi-square p-value above 1e-4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ChainVerifier = Callable[..., tuple[int, int]]


@dataclass(frozen=True)
class ExactnessResult:
    name: str
    trials: int
    vocab: int
    k: int
    max_sigma: float  # worst |count - expected| / sigma over positions and tokens
    min_p_value: float  # smallest chi-square p-value over positions
    impossible_tokens: int  # emitted tokens the target gives probability 0
    passed: bool

    def describe(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        return (
            f"{verdict} {self.name}: {self.trials} trials, V={self.vocab}, K={self.k}; worst deviation "
            f"{self.max_sigma:.2f} sigma, min chi-square p={self.min_p_value:.2e}, "
            f"impossible tokens {self.impossible_tokens}"
        )


def random_rows(rows: int, vocab: int, zeros: int, generator: torch.Generator) -> torch.Tensor:
    """[rows, V] distributions with `zeros` exact zeros per row and uneven mass elsewhere."""
    weights = torch.rand(rows, vocab, generator=generator, dtype=torch.float64) ** 3
    for r in range(rows):
        weights[r, torch.randperm(vocab, generator=generator)[:zeros]] = 0.0
    return weights / weights.sum(-1, keepdim=True)


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's statistic over the cells with expected > 0."""
    cells = expected > 0
    stat = ((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    dof = max(int(cells.sum()) - 1, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))


def check_chain_exactness(
    verify: ChainVerifier,
    k: int = 3,
    vocab: int = 16,
    trials: int = 65_536,
    seed: int = 0,
    name: str = "verify_chain",
    progress: Callable[[float], None] | None = None,
) -> ExactnessResult:
    gen = torch.Generator().manual_seed(seed)
    p_target = random_rows(k + 1, vocab, zeros=3, generator=gen)  # [K+1, V]
    p_draft = random_rows(k, vocab, zeros=3, generator=gen)  # [K, V]
    drafts = torch.multinomial(p_draft, trials, replacement=True, generator=gen).T  # [trials, K]
    counts = torch.zeros(k + 1, vocab, dtype=torch.float64)  # [K+1, V]
    reached = torch.zeros(k + 1, dtype=torch.float64)  # trials that emitted position j
    for t in range(trials):
        n, nxt = verify(p_target, p_draft, drafts[t], gen)
        emitted = drafts[t, :n].tolist() + [nxt]
        for j, token in enumerate(emitted):
            counts[j, token] += 1
            reached[j] += 1
        if progress and t % 4096 == 0:
            progress(t / trials)
    expected = reached[:, None] * p_target  # [K+1, V]
    sigma = (expected * (1 - p_target)).sqrt()
    deviation = (counts - expected).abs()
    max_sigma = float((deviation / sigma.clamp(min=1e-12)).where(expected > 0, torch.zeros(()) ).max())
    within = bool((deviation <= 6 * sigma + 5).all())
    p_values = [chi_square_p_value(counts[j], expected[j]) for j in range(k + 1) if reached[j] > 0]
    impossible = int(counts[p_target == 0].sum())
    min_p = min(p_values)
    passed = within and min_p > 1e-4 and impossible == 0
    return ExactnessResult(name, trials, vocab, k, max_sigma, min_p, impossible, passed)


@dataclass(frozen=True)
class SelftestReport:
    passed: bool
    lines: tuple[str, ...]


def run_selftest(
    engine=None,
    trials: int = 65_536,
    verify: ChainVerifier | None = None,
    progress: Callable[[str, float | None], None] | None = None,
    greedy_tokens: int = 32,
    verify_tree_fn: TreeVerifier | None = None,
) -> SelftestReport:
    """Exactness of the chain verifier (K = 1 and 3) and of the tree verifier (depth 3, siblings
    drawn without replacement) and, with an engine, greedy equality of every speculative method
    against plain decoding on the loaded models."""
    from speclens.engine.decoding.verify import verify_chain, verify_tree

    verify = verify or verify_chain
    verify_tree_fn = verify_tree_fn or verify_tree
    report = progress or (lambda message, fraction: None)
    lines: list[str] = []
    passed = True
    for k in (1, 3):
        label = f"chain exactness K={k}"
        result = check_chain_exactness(
            verify, k=k, trials=trials, seed=k, name=label, progress=lambda f, label=label: report(label, f)
        )
        lines.append(result.describe())
        passed &= result.passed
    label = "tree exactness (3, 2, 2) without replacement"
    result = check_tree_exactness(
        verify_tree_fn, trials=trials, seed=5, name=label, progress=lambda f: report(label, f)
    )
    lines.append(result.describe())
    passed &= result.passed
    if engine is not None:
        from speclens.engine.decoding.decode import GenerationConfig
        from speclens.engine.decoding.events import Summary

        prompt = engine.encode_chat([{"role": "user", "content": "List three colours, then repeat them."}])
        outputs = {}
        for method in engine.methods:
            report(f"greedy decoding with {method}", None)
            config = GenerationConfig(method=method, k=4, max_new_tokens=greedy_tokens)
            summary = [e for e in engine.generate_ids(prompt, config) if isinstance(e, Summary)][0]
            outputs[method] = summary.token_ids
        for method, ids in outputs.items():
            if method == "ar":
                continue
            same = ids == outputs["ar"]
            passed &= same
            lines.append(
                f"{'PASS' if same else 'FAIL'} greedy equality {method} vs ar on {engine.describe()}: "
                f"{len(ids)} tokens {'identical' if same else 'differ'}"
            )
        report("verification block against one-token decoding", None)
        line, ok = block_invariance_line(engine, prompt, list(outputs["ar"][:8]))
        lines.append(line)
        passed &= ok
    return SelftestReport(passed, tuple(lines))


def block_invariance_line(engine, prompt: list[int], block: list[int]) -> tuple[str, bool]:
    """Score `block` after `prompt` in one target forward (as verification does) and one token at a time
    (as plain decoding does). With SpecLens's native linears and attention the logits must agree bit
    for bit (a FAIL otherwise); on PyTorch's kernels they differ by rounding, reported for information."""
    from speclens.engine.runtime.attention import is_native_attention
    from speclens.engine.runtime.cache import CachedModel
    from speclens.engine.runtime.cpu_kernels import native_kernel_of

    target = engine.target_lm
    verified = CachedModel(target.model, target.n_vocab)
    verified.prefill(prompt)
    together = verified.forward(prompt, block, len(block) + 1)  # [len(block) + 1, V]
    decoded = CachedModel(target.model, target.n_vocab)
    decoded.prefill(prompt)
    alone = torch.stack([decoded.forward(prompt + block[:i], [], 1)[0] for i in range(len(block) + 1)])
    worst = (together - alone).abs().max().item()
    if native_kernel_of(target.model) is not None and is_native_attention(target.model):
        ok = torch.equal(together, alone)
        verdict = "bit for bit" if ok else f"differ by up to {worst:.2e}"
        return (f"{'PASS' if ok else 'FAIL'} block invariance on SpecLens's native kernels: a {len(block) + 1}-token "
                f"verification forward and one-token decoding give logits that {verdict}", ok)
    return (f"INFO block invariance: on PyTorch's kernels a {len(block) + 1}-token verification forward and one-token "
            f"decoding give logits that differ by up to {worst:.2e} (rounding; greedy equality is checked above)", True)


TreeVerifier = Callable[..., tuple[list[int], int]]
TREE_DRAFT_MODES = ("independent", "without_replacement", "deterministic")


def check_tree_exactness(
    verify: TreeVerifier,
    branching: tuple[int, ...] = (3, 2, 2),
    draft_mode: str = "without_replacement",
    vocab: int = 8,
    classes: int = 4,
    trials: int = 65_536,
    seed: int = 0,
    name: str = "verify_tree",
    progress: Callable[[float], None] | None = None,
) -> ExactnessResult:
    """Exactness of a tree verifier: the emitted token at position j, given the path emitted so far,
    must follow the target row of that path.

    The tree is full, with branching[d] children per node at depth d. Target and draft distributions
    depend on the token path: each path is mapped (at random) to one of `classes` rows per depth, so
    the check is a per-position chi-square conditional on the path's row (pooling paths that share
    a row is exact, as they share the distribution). Draft rows mix the target row with an unrelated
    one, so acceptance is neither rare nor certain. draft_mode says how siblings are drawn from q:
    i.i.d., without replacement, or deterministically as the top-k of q (verified as one-hot).
    """
    if draft_mode not in TREE_DRAFT_MODES:
        raise ValueError(f"draft_mode must be one of {TREE_DRAFT_MODES}, got {draft_mode!r}")
    gen = torch.Generator().manual_seed(seed)
    depth = len(branching)
    p_rows = random_rows((depth + 1) * classes, vocab, zeros=2, generator=gen)  # [(D+1)*R, V]
    other = random_rows(depth * classes, vocab, zeros=2, generator=gen)  # [D*R, V]
    q_rows = 0.5 * p_rows[: depth * classes] + 0.5 * other  # [D*R, V], row d*R + r for depth d
    # class of a path of length d: table[d][code], code = sum(token_i * V**i)
    p_class = [torch.randint(classes, (vocab**d,), generator=gen) + d * classes for d in range(depth + 1)]
    q_class = [torch.randint(classes, (vocab**d,), generator=gen) + d * classes for d in range(depth)]

    parents = [-1]
    node_depth = [0]
    levels = [[0]]
    for d, b in enumerate(branching):
        levels.append([])
        for parent in levels[d]:
            for _ in range(b):
                levels[d + 1].append(len(parents))
                parents.append(parent)
                node_depth.append(d + 1)
    n_nodes = len(parents)

    tokens = torch.zeros(trials, n_nodes, dtype=torch.long)  # root token 0 in every trial
    code = torch.zeros(trials, n_nodes, dtype=torch.long)  # path code of each node
    p_index = torch.zeros(trials, n_nodes, dtype=torch.long)  # target row of each node
    q_index = torch.zeros(trials, n_nodes, dtype=torch.long)  # draft row each node was drawn from
    p_index[:, 0] = p_class[0][0]
    for d, b in enumerate(branching):
        for parent in levels[d]:
            q_at_parent = q_class[d][code[:, parent]]  # [trials]
            q = q_rows[q_at_parent]  # [trials, V]
            if draft_mode == "deterministic":
                drawn = q.topk(b, dim=-1).indices  # [trials, b]
            else:
                drawn = torch.multinomial(q, b, replacement=draft_mode == "independent", generator=gen)
            kids = [n for n in levels[d + 1] if parents[n] == parent]
            tokens[:, kids] = drawn
            code[:, kids] = code[:, parent, None] + drawn * vocab**d
            q_index[:, kids] = q_at_parent[:, None]
            p_index[:, kids] = p_class[d + 1][code[:, kids]]

    cells: list[int] = []  # (target row of the path so far) * V + emitted token, per emitted token
    token_rows, p_index_rows = tokens.tolist(), p_index.tolist()
    for t in range(trials):
        draft_probs = None if draft_mode == "deterministic" else q_rows[q_index[t]]
        path, nxt = verify(
            p_rows[p_index[t]], draft_probs, tokens[t], parents, gen,
            without_replacement=draft_mode == "without_replacement",
        )
        emitted = [token_rows[t][node] for node in path] + [nxt]
        cells.extend(p_index_rows[t][node] * vocab + token for node, token in zip([0, *path], emitted))
        if progress and t % 4096 == 0:
            progress(t / trials)
    counts = torch.bincount(torch.tensor(cells), minlength=p_rows.numel()).double().view(p_rows.shape)

    reached = counts.sum(-1, keepdim=True)  # [(D+1)*R, 1]
    expected = reached * p_rows
    sigma = (expected * (1 - p_rows)).sqrt()
    deviation = (counts - expected).abs()
    max_sigma = float((deviation / sigma.clamp(min=1e-12)).where(expected > 0, torch.zeros(())).max())
    within = bool((deviation <= 6 * sigma + 5).all())
    p_values = [
        _pooled_chi_square_p_value(counts[d * classes : (d + 1) * classes], expected[d * classes : (d + 1) * classes])
        for d in range(depth + 1)
        if reached[d * classes : (d + 1) * classes].sum() > 0
    ]
    impossible = int(counts[p_rows == 0].sum())
    min_p = min(p_values)
    passed = within and min_p > 1e-4 and impossible == 0
    label = f"{name} [{draft_mode}, branching {'x'.join(map(str, branching))}]"
    return ExactnessResult(label, trials, vocab, depth, max_sigma, min_p, impossible, passed)


def _pooled_chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test over G independent groups at once: counts, expected [G, V]; each group that
    was reached contributes (its cells with expected > 0) - 1 degrees of freedom."""
    stat = torch.zeros((), dtype=torch.float64)
    dof = 0
    for c, e in zip(counts, expected):
        cells = e > 0
        if e.sum() <= 0:
            continue
        stat = stat + ((c[cells] - e[cells]) ** 2 / e[cells]).sum()
        dof += int(cells.sum()) - 1
    dof = max(dof, 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
