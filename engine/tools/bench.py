"""`speclens bench`: every decoding method side by side, in one process, on the same prompts.

Fairness rules:
- Prompt-major, rotating order: prompt i runs every method, starting with method i mod M, after one
  untimed warm-up run per method. Drift in machine speed (other processes, heat) hits all alike.
- Prefill is excluded, the same way for all: ours time the forward of prompt[:-1] that fills the
  cache and subtract it; for HF generate, the same forward is timed right before the call and
  subtracted. What remains is one prompt token plus decoding. (HF assisted generation still
  prefills its draft model inside the clock, ours outside: a small edge for ours, noted in settings.)
- Same settings: greedy or the same temperature / top-k / top-p, same EOS ids, same chat template.
- tokens/s of a method = all its new tokens / all its decode seconds, over every prompt.
- Peers: HF `generate` (plain, assisted, prompt lookup) on the same loaded model, and llama.cpp
  (`llama_cpp`, engine/tools/peers.py) on the same GGUF file, timed the same way.
- Exactness, greedy: each method's share of prompts whose tokens equal `ar`'s, and for each that
  differs the first differing token with the target's probabilities of both choices there (on a GPU
  a block of K + 1 tokens runs other matrix kernels than one token, so a near-tie can flip).
- `synthetic@A` (greedy only): a drafter with acceptance A per drafted position, replaying the
  target's own greedy answer (engine/drafters/synthetic.py): speed for targets nobody drafts for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

import torch

from speclens.engine.decoding.decode import GenerationConfig
from speclens.engine.decoding.events import StepEvent, Summary
from speclens.engine.decoding.limits import KNOWN_METHODS, MAX_K, SettingError
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.drafters.synthetic import SyntheticDrafter, greedy_reference
from speclens.engine.runtime.attention import is_native_attention
from speclens.engine.runtime.cache import sync
from speclens.engine.runtime.cpu_kernels import PackedLinear, is_packed, native_kernel_of, one_token_seconds
from speclens.engine.runtime.native_kernels import NativeLinear
from speclens.engine.tools.args import load_engine
from speclens.engine.tools.peers import LLAMA_CPP, llama_cpp_peer, llama_cpp_problem

HF_METHODS = ("hf_generate", "hf_assisted", "hf_lookup")
SYNTHETIC = "synthetic@"  # synthetic@0.8: the synthetic drafter at acceptance 0.8


def draft_length(method: str) -> tuple[str, int | None]:
    """`dflash:7` -> ("dflash", 7): one of our methods at its own draft length K, beside others at -k (a
    DFlash block proposes up to block - 1 tokens, a chain is best shorter); ("ar", None) for `ar`."""
    base, colon, k = method.partition(":")
    if not colon:
        return method, None
    if not k.isdigit() or not 1 <= int(k) <= MAX_K:
        raise SettingError(f"--methods: {method} needs a draft length from 1 to {MAX_K} after the colon, as in dflash:7")
    return base, int(k)


def synthetic_acceptance(method: str) -> float | None:
    """The acceptance of a `synthetic@A` method name (None for other names); ValueError if malformed."""
    if not method.startswith(SYNTHETIC):
        return None
    try:
        acceptance = float(method.removeprefix(SYNTHETIC))
    except ValueError:
        acceptance = math.nan
    if not 0.0 <= acceptance <= 1.0:
        raise SettingError(f"--methods: {method} needs an acceptance from 0 to 1, as in synthetic@0.8")
    return acceptance


@dataclass(frozen=True)
class Prompt:
    category: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class BenchOptions:
    methods: tuple[str, ...] | None = None  # None: every method available; `ar` is always added
    num_prompts: int | None = None  # None: all
    max_new_tokens: int = 128
    k: int = 4
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    warmup: bool = True
    threads: int | str | None = None  # CPU threads: None leaves torch's choice; "auto" measures (see pick_threads)


@dataclass(frozen=True)
class Run:
    """One method on one prompt."""

    method: str
    prompt: int
    category: str
    tokens: tuple[int, ...]
    seconds: float
    steps: int | None  # target passes that emitted tokens (HF's counted with a forward hook)
    position_drafted: tuple[int, ...] = ()
    position_accepted: tuple[int, ...] = ()
    accepted_by: tuple[tuple[str, int], ...] = ()  # accepted draft tokens per proposer
    draft_s: float = 0.0  # seconds spent drafting, within `seconds`


@dataclass(frozen=True)
class MethodResult:
    tokens_per_s: float
    speedup_vs_ar: float | None
    tau: float | None  # mean accepted length (new tokens per target pass), counting the correction/bonus token
    equal_to_ar: bool | None  # token-for-token equality with our `ar` at temperature 0, else None
    per_position_acceptance: tuple[float, ...]
    new_tokens: int
    seconds: float
    accepted_by: dict[str, int] = field(default_factory=dict)  # accepted draft tokens per proposer
    identical_share: float | None = None  # greedy: share of prompts whose tokens equal ar's
    draft_ms_per_step: float | None = None  # drafting time per target pass (ours; None for peers)
    diverged: tuple[str, ...] = ()  # greedy: where each differing prompt first differs, and why


@dataclass(frozen=True)
class BenchReport:
    methods: dict[str, MethodResult]
    categories: dict[str, dict[str, MethodResult]]
    settings: dict
    device: str
    runs: tuple[Run, ...] = field(repr=False, default=())

    def to_json(self) -> dict:
        return {
            "methods": {name: asdict(r) for name, r in self.methods.items()},
            "categories": {c: {name: asdict(r) for name, r in rs.items()} for c, rs in self.categories.items()},
            "settings": self.settings,
            "device": self.device,
        }


# --- prompts ---------------------------------------------------------------------------------


def bundled_prompts_path() -> Path:
    return Path(str(resources.files("speclens.resources") / "prompts" / "bench.jsonl"))


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Prompts from a JSONL file of {"category", "turns": [...]} (Spec-Bench's format)."""
    path = Path(path) if path else bundled_prompts_path()
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        turns = record.get("turns")
        if not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"{path}:{number}: expected a non-empty list of strings under 'turns'")
        prompts.append(Prompt(str(record.get("category", "uncategorised")), tuple(turns)))
    return prompts


def select_prompts(prompts: Sequence[Prompt], n: int | None) -> list[Prompt]:
    """The first n prompts taken round-robin over categories, so a small n still spans them all."""
    if n is None or n >= len(prompts):
        return list(prompts)
    by_category: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p)
    chosen: list[Prompt] = []
    for i in range(max(len(q) for q in by_category.values())):
        chosen += [q[i] for q in by_category.values() if i < len(q)]
    return chosen[:n]


# --- methods ---------------------------------------------------------------------------------


def available_methods(engine) -> tuple[str, ...]:
    hf = ("hf_generate", "hf_assisted", "hf_lookup") if engine.draft else ("hf_generate", "hf_lookup")
    peers = (LLAMA_CPP,) if llama_cpp_problem(engine) is None else ()
    return ("ar", *hf, *peers, *(m for m in engine.methods if m != "ar"))


def resolve_methods(engine, asked: Sequence[str] | None) -> tuple[str, ...]:
    available = available_methods(engine)
    if asked is None:
        return available
    synthetic = tuple(m for m in asked if synthetic_acceptance(m) is not None)
    lengths = tuple(m for m in asked if m != draft_length(m)[0] and draft_length(m)[0] in available)
    unknown = [m for m in asked if m not in available and m not in synthetic and m not in lengths]
    if LLAMA_CPP in unknown:  # say why, in one line
        raise ValueError(f"method {LLAMA_CPP} not available here: {llama_cpp_problem(engine)}")
    if unknown:
        raise ValueError(f"method(s) {', '.join(unknown)} not available here; choose from {', '.join(available)}")
    return tuple(m for m in available if m == "ar" or m in asked) + lengths + synthetic  # `ar` is the reference


def run_ours(engine, method: str, ids: list[int], options: BenchOptions, seed: int, max_new: int) -> Run:
    base, k = draft_length(method)
    config = GenerationConfig(
        method=base, k=k or options.k, sampling=options.sampling, max_new_tokens=max_new, seed=seed
    )
    engine.target_lm.reset()  # every run starts cold, like HF's
    drafted: list[int] = []
    accepted: list[int] = []
    summary = None
    draft_s = 0.0
    for event in engine.generate_ids(ids, config):
        if isinstance(event, StepEvent):
            draft_s += event.draft_s
            for i in range(event.drafted):
                if i == len(drafted):
                    drafted.append(0)
                    accepted.append(0)
                drafted[i] += 1
                accepted[i] += i < event.accepted
        elif isinstance(event, Summary):
            summary = event
    return Run(
        method, -1, "", summary.token_ids, summary.elapsed_s - summary.prefill_s, summary.steps,
        tuple(drafted), tuple(accepted), summary.accepted_by, draft_s,
    )


def run_hf(engine, method: str, ids: list[int], options: BenchOptions, seed: int, max_new: int) -> Run:
    from transformers import DynamicCache
    from transformers import GenerationConfig as HFGenerationConfig

    model = engine.target.model
    device = engine.target.device
    params = options.sampling
    assistant: dict = {}
    extra: dict = {}
    if method == "hf_assisted":
        assistant = {"assistant_model": engine.draft.model}
        extra = dict(num_assistant_tokens=options.k, num_assistant_tokens_schedule="constant",
                     assistant_confidence_threshold=0.0)
    elif method == "hf_lookup":
        extra = dict(prompt_lookup_num_tokens=options.k)
    if not params.greedy:
        # explicit, so HF's own defaults (top_k=50) never apply
        extra |= dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    if params.repetition_penalty != 1.0:
        extra |= dict(repetition_penalty=params.repetition_penalty)
    eos = list(engine.eos_ids)
    config = HFGenerationConfig(
        max_new_tokens=max_new,
        do_sample=not params.greedy,
        eos_token_id=eos or None,
        pad_token_id=eos[0] if eos else 0,
        **extra,
    )
    input_ids = torch.tensor([ids], device=device)
    with torch.inference_mode():
        # HF generate cannot be timed without its prefill (assisted and prompt-lookup generation go
        # wrong when handed a prefilled cache in transformers 5.24), so the same prefill of
        # prompt[:-1] that ours excludes is timed right before and subtracted.
        prefill_s = 0.0
        if len(ids) > 1:
            sync(device)
            start = time.perf_counter()
            model(input_ids=input_ids[:, :-1], cache=DynamicCache(config=model.config), use_cache=True)
            sync(device)
            prefill_s = time.perf_counter() - start
        torch.manual_seed(seed)
        # the target's forwards: the first also reads the prompt's last token (which ours counts as its
        # first step), then one per step, a verification in assisted and lookup generation
        passes = []
        counter = model.register_forward_pre_hook(lambda module, args: passes.append(1))
        try:
            start = time.perf_counter()
            out = model.generate(input_ids, generation_config=config, **assistant)
            sync(device)
            seconds = max(time.perf_counter() - start - prefill_s, 1e-9)
        finally:
            counter.remove()
    return Run(method, -1, "", tuple(out[0, len(ids):].tolist()), seconds, max(len(passes), 1))


def pick_threads(engine, ids: list[int], steps: int = 6) -> dict[int, float]:
    """On CPU, time a few plain decoding steps at 1 .. all cores' torch threads and keep the fastest.

    On a shared machine fewer threads can win by a lot (a preempted thread stalls every parallel
    op), so this is measured at run time rather than assumed. Returns tokens/s per thread count.
    """
    if engine.target.device.type != "cpu":
        return {}
    rates = {}
    for n in sorted({1, max(1, torch.get_num_threads()), max(1, os.cpu_count() or 1)}):
        torch.set_num_threads(n)
        run_ours(engine, "ar", ids, BenchOptions(), 0, 2)  # let the new thread pool settle
        run = run_ours(engine, "ar", ids, BenchOptions(), 0, steps)
        rates[n] = len(run.tokens) / run.seconds
    torch.set_num_threads(max(rates, key=rates.get))
    return rates


VERIFY_SIZES = (1, 2, 3, 5, 9, 17, 33)  # plain step, chains of K = 1, 2, 4, 8, trees of 16 and 32 nodes


def verify_cost(engine, ids: list[int], sizes: Sequence[int] = VERIFY_SIZES, rounds: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over T new tokens, with logits for all T as a verify step
    needs, after ids[:-1] are cached; per T. Rounds interleave the sizes (the first is a warm-up).

    This curve decides what a draft can pay for on a device: a step that emits tau tokens costs
    cost(T) plus drafting, so speculation wins only where tau / (cost(T) / cost(1)) exceeds 1 by
    more than the draft's share. Measured, because it depends on the CPU, dtype and threads."""
    return engine.target_lm.time_forwards(ids, sizes, rounds)


def one_row_kernels(engine) -> tuple[float, float] | None:
    """Where the target runs single rows on stock kernels (auto measured them faster at load): the
    median seconds of a one-token forward on stock and on packed kernels, timed again now."""
    model = engine.target.model
    if not any(isinstance(m, PackedLinear) and m.one_row_stock for m in model.modules()):
        return None
    return one_token_seconds(model)


def verify_cost_markdown(engine, costs: dict[int, float], context: int) -> str:
    base = costs[min(costs)]
    rows = "\n".join(f"| {t} | {1000 * c:.1f} | {c / base:.2f}x |" for t, c in costs.items())
    return (f"{engine.target.name} on {describe_target(engine)}; one forward of T new "
            f"tokens after {context} cached, median\n\n| T | ms | vs T={min(costs)} |\n|---:|---:|---:|\n{rows}\n")


def set_threads(engine, ids: list[int], threads: int | str | None) -> dict[int, float] | None:
    """Apply BenchOptions.threads: a number, "auto" (measured on ids, see pick_threads; returns the
    rates) or None (torch's choice)."""
    rates = pick_threads(engine, ids[:128]) if threads == "auto" else None
    if isinstance(threads, int):
        torch.set_num_threads(threads)
    if threads is not None:
        engine.remeasure_lookup_cost()  # what a verified token costs depends on the threads
    return rates


def run_llama_cpp(engine, method: str, ids: list[int], options: BenchOptions, seed: int, max_new: int) -> Run:
    if not options.sampling.greedy or options.sampling.repetition_penalty != 1.0:
        raise ValueError(f"{LLAMA_CPP} is measured greedy only (temperature 0, no repetition penalty)")
    peer = llama_cpp_peer(engine, torch.get_num_threads(), len(ids) + max_new + 8)
    tokens, seconds = peer.generate(ids, max_new, frozenset(engine.eos_ids))
    return Run(method, -1, "", tokens, max(seconds, 1e-9), len(tokens))  # one forward per token


def run_synthetic(engine, method: str, ids: list[int], options: BenchOptions, seed: int, max_new: int) -> Run:
    """The synthetic drafter at the method's acceptance over the target's greedy answer (made untimed)."""
    if not options.sampling.greedy:
        raise ValueError(f"{method} drafts from the target's greedy answer: run it at temperature 0")
    engine.target_lm.reset()
    reference = greedy_reference(engine.target_lm, ids, max_new)
    drafter = SyntheticDrafter(reference, synthetic_acceptance(method), engine.target_lm.n_vocab, seed)
    with engine.extra_drafter(method, drafter):
        return run_ours(engine, method, ids, options, seed, max_new)


def run_method(engine, method: str, ids: list[int], options: BenchOptions, seed: int, max_new: int) -> Run:
    if synthetic_acceptance(method) is not None:
        return run_synthetic(engine, method, ids, options, seed, max_new)
    if method == LLAMA_CPP:
        return run_llama_cpp(engine, method, ids, options, seed, max_new)
    runner = run_hf if method in HF_METHODS else run_ours
    return runner(engine, method, ids, options, seed, max_new)


# --- the benchmark ---------------------------------------------------------------------------


def run_bench(
    engine,
    prompts: Sequence[Prompt],
    options: BenchOptions = BenchOptions(),
    progress: bool = False,
    settings: dict | None = None,
) -> BenchReport:
    """Run every method on every prompt (prompt-major, rotating order) and aggregate."""
    from tqdm import tqdm

    methods = resolve_methods(engine, options.methods)
    prompts = select_prompts(prompts, options.num_prompts)
    if not prompts:
        raise ValueError("no prompts to run")
    encoded = [engine.encode_chat([{"role": "user", "content": p.turns[0]}]) for p in prompts]

    threads = set_threads(engine, encoded[0], options.threads)
    if options.warmup:
        for method in methods:
            run_method(engine, method, encoded[0], options, options.seed, min(16, options.max_new_tokens))

    runs: list[Run] = []
    bar = tqdm(total=len(prompts) * len(methods), file=sys.stderr, desc="bench", disable=not progress)
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        r = i % len(methods)
        for method in methods[r:] + methods[:r]:
            bar.set_postfix_str(f"{prompt.category}: {method}")
            run = run_method(engine, method, ids, options, options.seed + i, options.max_new_tokens)
            runs.append(replace(run, prompt=i, category=prompt.category))
            bar.update()
    bar.close()

    greedy = options.sampling.greedy
    results = aggregate(runs, methods, greedy)
    if greedy:  # say where and why each differing output differs
        plain = {r.prompt: r.tokens for r in runs if r.method == "ar"}
        for method, result in results.items():
            notes = tuple(
                f"prompt {r.prompt}: " + explain_divergence(engine, encoded[r.prompt], plain[r.prompt], r.tokens)
                for r in runs if r.method == method and r.prompt in plain and r.tokens != plain[r.prompt])
            results[method] = replace(result, diverged=notes)
    categories = {c: aggregate([r for r in runs if r.category == c], methods, greedy)
                  for c in dict.fromkeys(p.category for p in prompts)}
    all_settings = {
        "target": engine.target.name,
        "draft": engine.draft.name if engine.draft else None,
        "methods": list(methods),
        "num_prompts": len(prompts),
        "max_new_tokens": options.max_new_tokens,
        "k": options.k,
        "temperature": options.sampling.temperature,
        "top_k": options.sampling.top_k,
        "top_p": options.sampling.top_p,
        "seed": options.seed,
        "warmup": options.warmup,
        "turns": "first turn of each prompt, through the chat template",
        "timing": "decode wall time per generation: wall time minus a timed target prefill of prompt[:-1] "
        "(HF assisted generation also prefills its draft model, which stays inside its time)",
        "torch": torch.__version__,
        "transformers": _transformers_version(),
        "threads": torch.get_num_threads(),
        "threads_measured_tokens_per_s": threads if isinstance(threads, dict) else None,
        "runtime": engine.target_lm.runtime,
        **(settings or {}),
    }
    return BenchReport(results, categories, all_settings,
                       describe_target(engine), tuple(runs))


def aggregate(runs: Sequence[Run], methods: Sequence[str], greedy: bool) -> dict[str, MethodResult]:
    reference = {r.prompt: r.tokens for r in runs if r.method == "ar"}
    ar_rate = _rate([r for r in runs if r.method == "ar"])
    results = {}
    for method in methods:
        mine = [r for r in runs if r.method == method]
        if not mine:
            continue
        new_tokens = sum(len(r.tokens) for r in mine)
        seconds = sum(r.seconds for r in mine)
        steps = sum(r.steps for r in mine) if all(r.steps is not None for r in mine) else None
        depth = max(len(r.position_drafted) for r in mine)
        drafted = [sum(r.position_drafted[i] for r in mine if i < len(r.position_drafted)) for i in range(depth)]
        accepted = [sum(r.position_accepted[i] for r in mine if i < len(r.position_accepted)) for i in range(depth)]
        rate = _rate(mine)
        by: Counter[str] = Counter()
        for run in mine:
            by.update(dict(run.accepted_by))
        results[method] = MethodResult(
            tokens_per_s=rate,
            speedup_vs_ar=rate / ar_rate if ar_rate else None,
            tau=new_tokens / steps if steps else None,
            equal_to_ar=all(r.tokens == reference.get(r.prompt) for r in mine) if greedy else None,
            per_position_acceptance=tuple(a / d for a, d in zip(accepted, drafted)),
            new_tokens=new_tokens,
            seconds=seconds,
            accepted_by=dict(by.most_common()),
            identical_share=sum(r.tokens == reference.get(r.prompt) for r in mine) / len(mine) if greedy else None,
            draft_ms_per_step=1000 * sum(r.draft_s for r in mine) / steps
            if steps and method not in (*HF_METHODS, LLAMA_CPP) else None,
        )
    return results


def explain_divergence(engine, ids: list[int], plain: Sequence[int], other: Sequence[int]) -> str:
    """Where a greedy output first differs from plain decoding's, with the target's probabilities of both
    tokens there (computed again by one forward of the shared prefix): a near-tie, or a real bug."""
    n = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    if n == min(len(plain), len(other)):
        return f"stopped at token {n} where the other ran on ({len(plain)} vs {len(other)} tokens)"
    engine.target_lm.reset()
    p_target = torch.softmax(engine.target_lm.forward(list(ids) + list(plain[:n]), [], 1)[0].float(), -1)
    engine.target_lm.reset()
    return (f"diverged at token {n}: near-tie of p={p_target[plain[n]].item():.4f} (plain's token) vs "
            f"p={p_target[other[n]].item():.4f} (this method's)")


def _rate(runs: Sequence[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds > 0 else 0.0


def describe_target(engine) -> str:
    """Device, dtype and (on CPU) which linear kernels the target runs."""
    kernels = ""
    if native_kernel_of(engine.target.model) is not None:
        attention = is_native_attention(engine.target.model)
        what = "decoder" if engine.target_lm.lean is not None else f"linears{' and attention' if attention else ''}"
        kernel = native_kernel_of(engine.target.model)
        integer = any(getattr(m, "integer", False) for m in engine.target.model.modules())
        bits = 16 if getattr(engine.target.model.get_output_embeddings(), "residual", False) else 8
        kernels = (f", SpecLens's native {what} (integer: {bits}-bit activations, {kernel.integer_isa()})" if integer
                   else f", SpecLens's native {what} (float32, {kernel.isa()})")
    elif is_packed(engine.target.model):
        layers = [m for m in engine.target.model.modules() if isinstance(m, PackedLinear)]
        stock = sum(m.one_row_stock for m in layers)
        mkl = sum(m.mkl_blocks for m in layers)
        kernels = ", oneDNN-packed linears" + (f" (one-token products on stock kernels in {stock} of {len(layers)})"
                                              if stock else "")
        if mkl:
            kernels += f", blocks on MKL-packed weights in {mkl} of {len(layers)}"
    if not kernels or engine.target_lm.lean is None:  # not the native decoder: say which forward runs
        kernels += f", {engine.target_lm.runtime}"
    return f"{describe_device(engine.target.device)}, {str(engine.target.model.dtype).removeprefix('torch.')}{kernels}"


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    if device.type == "cpu":
        return f"cpu: {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return device.type


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# --- output ----------------------------------------------------------------------------------


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else format(value, pattern)


def markdown(report: BenchReport) -> str:
    s = report.settings
    lines = [
        f"{s['target']}" + (f" + draft {s['draft']}" if s["draft"] else "")
        + f" on {report.device}; {s['num_prompts']} prompts, max {s['max_new_tokens']} new tokens, "
        f"K={s['k']}, temperature {s['temperature']}",
        "",
        "| method | tok/s | speedup vs ar | tau | equal to ar | acceptance by position | draft ms/step | new tokens "
        "| seconds |",
        "|---|---:|---:|---:|:---:|---|---:|---:|---:|",
    ]
    for name, r in report.methods.items():
        equal = {True: "yes", False: f"NO ({r.identical_share:.0%} identical)" if r.identical_share is not None
                 else "NO", None: "-"}[r.equal_to_ar]
        accept = " ".join(f"{a:.2f}" for a in r.per_position_acceptance) or "-"
        lines.append(
            f"| {name} | {r.tokens_per_s:.1f} | {_fmt(r.speedup_vs_ar, '.2f')}x | {_fmt(r.tau, '.2f')} | {equal} "
            f"| {accept} | {_fmt(r.draft_ms_per_step, '.2f')} | {r.new_tokens} | {r.seconds:.1f} |"
        )
    names = list(report.methods)
    lines += ["", "Acceptance by position i: of the steps that drafted more than i tokens, the share that accepted "
              "more than i (so it can rise with i: steps that reach a deep position tend to be the easy ones)."]
    lines += [
        "",
        "| category | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for category, results in report.categories.items():
        cells = [
            f"{results[n].tokens_per_s:.1f} ({_fmt(results[n].speedup_vs_ar, '.2f')}x"
            + (f", tau {results[n].tau:.2f})" if results[n].tau is not None and n != "ar" else ")")
            + (" NOT EQUAL to ar" if results[n].equal_to_ar is False else "")
            if n in results else "-"
            for n in names
        ]
        lines.append(f"| {category} | " + " | ".join(cells) + " |")
    differing = [(name, note) for name, r in report.methods.items() for note in r.diverged]
    if differing:  # every differing output, where it differs and the target's two probabilities there
        lines += ["", "| method | output differing from ar |", "|---|---|"]
        lines += [f"| {name} | {note} |" for name, note in differing]
    mixed = {name: r.accepted_by for name, r in report.methods.items() if len(r.accepted_by) > 1}
    if mixed:  # methods that verify several drafters' proposals in one pass: whose tokens were accepted
        lines += ["", "| method | accepted draft tokens by proposer |", "|---|---|"]
        for name, by in mixed.items():
            total = sum(by.values())
            lines.append(f"| {name} | " + ", ".join(f"{p} {n} ({n / total:.0%})" for p, n in by.items()) + " |")
    return "\n".join(lines) + "\n"


def write_chart(report: BenchReport, path: str | Path) -> None:
    """A PNG bar chart of tokens/s per method, drawn offscreen with pyqtgraph."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before Qt starts; no window is shown
    import pyqtgraph as pg
    from pyqtgraph.exporters import ImageExporter

    app = pg.mkQApp()
    names = list(report.methods)
    rates = [report.methods[n].tokens_per_s for n in names]
    colours = ["#888888" if n == "ar" else "#d08030" if n.startswith("hf_") else "#3070c0" for n in names]
    plot = pg.PlotWidget(background="w")
    plot.resize(max(480, 110 * len(names)), 420)
    plot.addItem(pg.BarGraphItem(x=list(range(len(names))), height=rates, width=0.6, brushes=colours))
    for x, (name, rate) in enumerate(zip(names, rates)):
        speedup = report.methods[name].speedup_vs_ar
        label = pg.TextItem(f"{rate:.1f}" + (f"\n{speedup:.2f}x" if speedup else ""), color="k", anchor=(0.5, 1))
        label.setPos(x, rate)
        plot.addItem(label)
    plot.getAxis("bottom").setTicks([list(enumerate(names))])
    plot.setLabel("left", "tokens / s")
    plot.setTitle(f"{report.settings['target']}: tokens/s and speedup over plain decoding", color="k", size="10pt")
    plot.setXRange(-0.5, len(names) - 0.5, padding=0.02)  # every name under its own bar
    plot.setYRange(0, max(rates) * 1.2 if rates else 1)
    plot.show()  # laid out at its size before export; offscreen, nothing appears
    app.processEvents()
    ImageExporter(plot.plotItem).export(str(path))
    plot.close()


# --- command line ----------------------------------------------------------------------------


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", default=None,
                        help="JSONL of {category, turns} (Spec-Bench format); default: the bundled set")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts to run, spread over categories")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("-k", "--draft-length", dest="k", type=int, default=4, help="draft length K")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset, e.g. ar,hf_generate,lookup (ar always runs); METHOD:K runs one of ours "
                        "at its own draft length, e.g. dflash:7")
    parser.add_argument("--threads", default="auto",
                        help="torch CPU threads: a number, or 'auto' to time 1..all cores first and keep the fastest")
    parser.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run per method")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="write the tables as Markdown here")
    parser.add_argument("--chart", default=None, help="write a PNG bar chart here")
    parser.add_argument("--verify-cost", action="store_true",
                        help="instead: time one target forward of T = 1..33 new tokens (what verifying costs here)")
    parser.add_argument("--kernel-agreement", action="store_true",
                        help="instead: teacher-force the prompts' text through the target on these --cpu-kernels and "
                             "on the float32 native kernels; report top-1 agreement and both perplexities")


def cmd_bench(args: argparse.Namespace, engine_factory: Callable | None = None) -> int:
    try:
        options = BenchOptions(
            methods=tuple(m.strip() for m in args.methods.split(",") if m.strip()) if args.methods else None,
            num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens,
            k=args.k,
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p),
            seed=args.seed,
            warmup=not args.no_warmup,
            threads="auto" if args.threads == "auto" else int(args.threads),
        )
        GenerationConfig(k=options.k, max_new_tokens=options.max_new_tokens)  # validates both
        unknown = [m for m in options.methods or () if m not in (*KNOWN_METHODS, *HF_METHODS, LLAMA_CPP)
                   and synthetic_acceptance(m) is None and draft_length(m)[0] not in KNOWN_METHODS[1:]]
        if unknown:  # said before loading; which known ones this pair offers is said after
            raise SettingError(f"--methods: unknown {', '.join(unknown)}; known: "
                               f"{', '.join((*KNOWN_METHODS, *HF_METHODS, LLAMA_CPP))}")
        if isinstance(options.threads, int) and not 1 <= options.threads <= 1024:
            raise ValueError(f"--threads must be a number of threads from 1, or auto, got {options.threads}")
        if options.num_prompts is not None and options.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {options.num_prompts}")
        prompts = load_prompts(args.prompts)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine = (engine_factory or load_engine)(args)
    if args.verify_cost:
        return _cmd_verify_cost(engine, prompts, options, args)
    if args.kernel_agreement:
        return _cmd_kernel_agreement(engine, prompts, options, args)
    try:
        report = run_bench(engine, prompts, options, progress=True,
                           settings={"prompts": str(args.prompts or bundled_prompts_path().name)})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = markdown(report)
    print(table, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.chart:
        write_chart(report, args.chart)
    return 0


def kernel_agreement(model, reference, texts: Sequence[list[int]], rows=None) -> dict:
    """Teacher-forced over each token list: how often model's top-1 next token is reference's, and the
    perplexity of the text under each (the mean negative log-likelihood of every next token, exp'd).
    `rows`, if given, replaces model: an iterator of logits [T - 1, V'] per text (a peer's)."""
    agree = positions = 0
    nll = nll_reference = 0.0
    texts = [ids for ids in texts if len(ids) >= 2]
    rows = iter(rows) if rows is not None else None
    with torch.no_grad():
        for ids in texts:
            x = torch.tensor([ids])
            wanted = reference(x).logits[0, :-1].double()  # [T-1, V]
            logits = (next(rows) if rows is not None else model(x).logits[0, :-1]).double()[:, : wanted.shape[-1]]
            nexts = x[0, 1:]
            agree += int((logits.argmax(-1) == wanted.argmax(-1)).sum())
            positions += len(ids) - 1
            nll -= float(logits.log_softmax(-1).gather(1, nexts[:, None]).sum())
            nll_reference -= float(wanted.log_softmax(-1).gather(1, nexts[:, None]).sum())
    n = max(positions, 1)
    return {"positions": positions, "top1_agreement": agree / n, "perplexity": math.exp(nll / n),
            "reference_perplexity": math.exp(nll_reference / n)}


def _cmd_kernel_agreement(engine, prompts: Sequence[Prompt], options: BenchOptions, args: argparse.Namespace) -> int:
    from speclens.engine.runtime.models import LoadOptions, load_model

    if engine.target.device.type != "cpu":
        print("error: --kernel-agreement compares CPU kernels; load the target on the CPU", file=sys.stderr)
        return 2
    reference = load_model(args.target, LoadOptions(device="cpu", dtype="float32", cpu_kernels="native",
                                                    trust_remote_code=args.trust_remote_code)).model
    tokenizer = engine.target.tokenizer
    chosen = select_prompts(prompts, options.num_prompts)
    texts = [tokenizer("\n\n".join(p.turns), add_special_tokens=False)["input_ids"] for p in chosen]
    texts = [ids for ids in texts if len(ids) >= 2]  # a next token to predict
    result = kernel_agreement(engine.target.model, reference, texts)
    result["kernels"] = describe_target(engine)
    result["prompts"] = len(chosen)
    print(f"{engine.target.name}: {result['kernels']} against float32 native kernels, teacher-forced over "
          f"{result['positions']} tokens of {len(chosen)} prompts' text\n"
          f"top-1 agreement {result['top1_agreement']:.2%}; perplexity {result['perplexity']:.4f} against "
          f"{result['reference_perplexity']:.4f} ({result['perplexity'] / result['reference_perplexity'] - 1:+.2%})")
    if llama_cpp_problem(engine) is None:  # the peer on the same GGUF, the same text, the same reference
        from speclens.engine.tools.peers import llama_cpp_logits

        peer = kernel_agreement(None, reference, texts, llama_cpp_logits(engine, texts, torch.get_num_threads()))
        result[LLAMA_CPP] = peer
        print(f"llama.cpp on the same GGUF: top-1 agreement {peer['top1_agreement']:.2%}; perplexity "
              f"{peer['perplexity']:.4f} ({peer['perplexity'] / peer['reference_perplexity'] - 1:+.2%})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def weight_bytes(model) -> int:
    """Bytes one forward streams from the model's linear weights: a native linear's panels or blocks as
    held, another linear's weight."""
    total = 0
    for module in model.modules():
        held = module.panels if isinstance(module, NativeLinear) else None
        if held is None and isinstance(module, torch.nn.Linear):
            held = module.weight
        total += held.numel() * held.element_size() if held is not None else 0
    return total


def memory_floor(nbytes: int, rounds: int = 7) -> tuple[float, float]:
    """(seconds to read `nbytes` once, bandwidth in bytes/s) at this many threads: the best of `rounds`
    sums over a 512 MB buffer (larger than any cache, so each round reads memory), scaled to nbytes."""
    buffer = torch.ones(128 * 2**20)  # float32: 512 MB
    buffer.sum()
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    bandwidth = buffer.numel() * buffer.element_size() / best
    return nbytes / bandwidth, bandwidth


def _cmd_verify_cost(engine, prompts: Sequence[Prompt], options: BenchOptions, args: argparse.Namespace) -> int:
    ids = engine.encode_chat([{"role": "user", "content": select_prompts(prompts, 1)[0].turns[0]}])
    set_threads(engine, ids, options.threads)
    costs = verify_cost(engine, ids)
    print(verify_cost_markdown(engine, costs, len(ids) - 1), end="")
    floor = None
    if engine.target.device.type == "cpu":
        nbytes = weight_bytes(engine.target.model)
        floor, bandwidth = memory_floor(nbytes)
        print(f"\nMemory floor: the linears' {nbytes / 2**20:.0f} MiB read once at {bandwidth / 1e9:.1f} GB/s "
              f"(a 512 MB sum, {torch.get_num_threads()} threads) = {1000 * floor:.2f} ms; "
              f"T={min(costs)} is {costs[min(costs)] / floor:.2f}x of it")
    kernels = one_row_kernels(engine)
    if kernels:
        print(f"\nOne-token forward (no cache), single rows on stock kernels: {1000 * kernels[0]:.1f} ms; "
              f"on packed kernels: {1000 * kernels[1]:.1f} ms (measured in alternation; auto chose stock)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": describe_target(engine),
                                               "dtype": str(engine.target.model.dtype), "context": len(ids) - 1,
                                               "verify_ms": {str(t): 1000 * c for t, c in costs.items()},
                                               "memory_floor_ms": None if floor is None else 1000 * floor,
                                               "weight_bytes": weight_bytes(engine.target.model),
                                               "threads": torch.get_num_threads(), "cpu": platform.processor()
                                               or platform.machine()}, indent=2) + "\n")
    return 0
