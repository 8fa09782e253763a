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
) -> SelftestReport:
    """Exactness of the chain verifier (K = 1 and 3) and, with an engine, greedy equality of every
    speculative method against plain decoding on the loaded models."""
    from engine.verify import verify_chain

    verify = verify or verify_chain
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
    if engine is not None:
        from engine.decode import GenerationConfig
        from engine.events import Summary

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
    return SelftestReport(passed, tuple(lines))
