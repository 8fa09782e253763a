import json
import math

import pytest
import torch

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.events import StepEvent
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.drafters.synthetic import SyntheticDrafter, greedy_reference
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.tools.bench import BenchOptions, Prompt, load_prompts, markdown, run_bench, select_prompts
from speclens.engine.tools.cli import build_parser
from tests.tiny import hf_greedy, make_tiny_engine, tiny_llama, tiny_tokenizer

PROMPTS = [
    Prompt("copy", ("Repeat: one two three four five six one two three four",)),
    Prompt("code", ("def add(a, b):\n    return a + b\n",)),
    Prompt("copy", ("The capital of France is Paris. The capital of Italy is Rome.",)),
]
REQUIRED = {"tokens_per_s", "speedup_vs_ar", "tau", "equal_to_ar", "per_position_acceptance", "new_tokens", "seconds",
            "accepted_by", "identical_share", "diverged", "draft_ms_per_step"}


@pytest.fixture(scope="module")
def engine():
    return make_tiny_engine()


@pytest.fixture(scope="module")
def greedy_report(engine):
    return run_bench(engine, PROMPTS, BenchOptions(max_new_tokens=20, k=3))


def test_greedy_bench_runs_every_method_and_all_equal_ar(engine, greedy_report):
    methods = greedy_report.methods
    assert {"ar", "hf_generate", "hf_assisted", "hf_lookup"} <= set(methods)
    assert set(engine.methods) <= set(methods)  # every method of ours, whatever engine.methods holds
    for name, result in methods.items():
        assert result.equal_to_ar is True, name
        assert result.new_tokens == 20 * len(PROMPTS)
        assert result.tokens_per_s > 0 and result.seconds > 0
    assert methods["ar"].speedup_vs_ar == pytest.approx(1.0)
    assert methods["ar"].tau == pytest.approx(1.0)
    # HF's target forwards are counted: one token each for plain generate, more where drafts are accepted
    assert methods["hf_generate"].tau == pytest.approx(1.0) and methods["hf_generate"].per_position_acceptance == ()
    assert methods["hf_lookup"].tau > 1.0 and methods["hf_assisted"].tau >= 1.0  # the tiny draft rarely agrees
    assert methods["lookup"].tau >= 1.0 and 1 <= len(methods["lookup"].per_position_acceptance) <= 3
    assert set(greedy_report.categories) == {"copy", "code"}
    assert "| hf_generate |" in markdown(greedy_report)


def test_runs_are_prompt_major_with_rotating_order(greedy_report):
    methods = list(greedy_report.methods)
    for i in range(len(PROMPTS)):
        order = [r.method for r in greedy_report.runs if r.prompt == i]
        r = i % len(methods)
        assert order == methods[r:] + methods[:r]


def test_json_has_the_documented_form(greedy_report, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(greedy_report.to_json()))
    data = json.loads(path.read_text())
    assert set(data) == {"methods", "categories", "settings", "device"}
    for result in data["methods"].values():
        assert set(result) == REQUIRED
    for per_method in data["categories"].values():
        assert set(per_method["ar"]) == REQUIRED
    assert data["methods"]["ar"]["accepted_by"] == {}
    assert all(r["identical_share"] == 1.0 and r["diverged"] == [] for r in data["methods"].values())
    assert data["methods"]["hf_generate"]["draft_ms_per_step"] is None  # not ours to time
    assert data["methods"]["draft"]["draft_ms_per_step"] > data["methods"]["ar"]["draft_ms_per_step"] >= 0
    lookup = data["methods"]["lookup"]
    assert set(lookup["accepted_by"]) == {"lookup"} and lookup["accepted_by"]["lookup"] > 0


def test_sampling_bench_reports_no_equality(engine):
    options = BenchOptions(methods=("hf_generate", "lookup"), max_new_tokens=8, k=2,
                           sampling=SamplingParams(temperature=0.8, top_k=20), warmup=False)
    report = run_bench(engine, PROMPTS[:2], options)
    assert list(report.methods) == ["ar", "hf_generate", "lookup"]
    assert all(r.equal_to_ar is None for r in report.methods.values())


def test_unknown_method_is_refused(engine):
    with pytest.raises(ValueError, match="not available"):
        run_bench(engine, PROMPTS, BenchOptions(methods=("medusa",)))


def test_cli_writes_json_markdown_and_chart(engine, tmp_path, capsys):
    from speclens.engine.tools.bench import cmd_bench

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"category": p.category, "turns": list(p.turns)}) + "\n" for p in PROMPTS))
    out = {name: tmp_path / name for name in ("b.json", "b.md", "b.png")}
    args = build_parser().parse_args([
        "bench", "--prompts", str(prompts), "--num-prompts", "2", "--max-new-tokens", "6",
        "--methods", "hf_generate,lookup", "--threads", "1", "--no-warmup",
        "--json", str(out["b.json"]), "--markdown", str(out["b.md"]), "--chart", str(out["b.png"]),
    ])
    assert cmd_bench(args, engine_factory=lambda _: engine) == 0
    data = json.loads(out["b.json"].read_text())
    assert set(data["methods"]) == {"ar", "hf_generate", "lookup"}
    assert data["methods"]["lookup"]["equal_to_ar"] is True
    printed = capsys.readouterr().out
    assert "| lookup |" in printed and printed == out["b.md"].read_text()
    assert out["b.png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PySide6.QtGui import QImage

    chart = QImage(str(out["b.png"]))
    assert (chart.width(), chart.height()) == (480, 420)  # laid out at its own size (unlaid: Qt's 640 x 480)


def test_bundled_prompts_and_round_robin_selection():
    prompts = load_prompts()
    assert len(prompts) >= 20 and all(p.turns for p in prompts)
    chosen = select_prompts(prompts, 5)
    assert len({p.category for p in chosen}) == 5


@pytest.mark.parametrize("acceptance", [0.5, 0.8])
def test_synthetic_drafter_acceptance_is_close_to_a(acceptance):
    model = tiny_llama(seed=0)
    prompt = tiny_tokenizer()("one two three four five")["input_ids"]
    n = 400
    reference = greedy_reference(CachedModel(model), prompt, n)
    drafter = SyntheticDrafter(reference, acceptance, vocab=model.config.vocab_size, seed=1)
    events = list(generate(CachedModel(model), tiny_tokenizer(), prompt, GenerationConfig(k=4, max_new_tokens=n), drafter))
    summary = events[-1]
    assert list(summary.token_ids) == reference[len(prompt):]  # exact: drafts never change the output
    # each drafted position up to the first rejection is one Bernoulli(a) trial
    rejections = sum(1 for e in events if isinstance(e, StepEvent) and e.accepted < e.drafted)
    measured = summary.accepted / (summary.accepted + rejections)
    assert measured == pytest.approx(acceptance, abs=0.07)
    assert summary.per_position_acceptance[0] == pytest.approx(acceptance, abs=0.1)


def test_verify_cost_times_every_size_and_leaves_the_cache_as_it_found_it(engine, tmp_path, capsys):
    from speclens.engine.tools.bench import VERIFY_SIZES, cmd_bench, verify_cost

    ids = engine.encode_chat([{"role": "user", "content": PROMPTS[0].turns[0]}])
    costs = verify_cost(engine, ids, sizes=(1, 3, 9), rounds=2)
    assert list(costs) == [1, 3, 9] and all(c > 0 for c in costs.values())
    assert engine.target_lm.cached_ids == ids[:-1]  # every timed block was rolled back
    args = build_parser().parse_args(["bench", "--verify-cost", "--threads", "1", "--json", str(tmp_path / "v.json")])
    assert cmd_bench(args, engine_factory=lambda _: engine) == 0
    out = json.loads((tmp_path / "v.json").read_text())
    assert list(out["verify_ms"]) == [str(t) for t in VERIFY_SIZES]
    assert f"| {VERIFY_SIZES[-1]} |" in capsys.readouterr().out


def test_verify_cost_compares_one_row_kernels_where_the_target_keeps_both():
    from speclens.engine.runtime.cpu_kernels import PackedLinear, pack_model, packed_kernels_work
    from speclens.engine.tools.bench import one_row_kernels

    if not packed_kernels_work(__import__("torch").float32):
        pytest.skip("no oneDNN packed linear in this torch")
    for mode, compared in (("stock", True), ("packed", False)):
        engine = make_tiny_engine(draft=False)
        assert pack_model(engine.target.model, one_row=mode)
        kernels = one_row_kernels(engine)
        assert (kernels is not None) == compared, mode
        if compared:
            assert all(t > 0 for t in kernels)
            # timing both ways leaves the target as it was: single rows on stock kernels
            assert all(m.one_row_stock for m in engine.target.model.modules() if isinstance(m, PackedLinear))


def test_setting_threads_measures_prompt_lookups_cost_again(engine):
    """What a verified token costs depends on the thread count, so --threads times the forwards again."""
    from speclens.engine.tools.bench import set_threads

    before = torch.get_num_threads()
    measured = engine.lookup_cost
    assert measured is not None and engine.drafter("lookup").step_cost is measured  # a CPU: measured at load
    try:
        set_threads(engine, [1, 2, 3], 1)
        assert engine.lookup_cost is not measured and engine.drafter("lookup").step_cost is engine.lookup_cost
        assert set_threads(engine, [1, 2, 3], None) is None and engine.drafter("lookup").step_cost is engine.lookup_cost
    finally:
        torch.set_num_threads(before)


def test_a_target_too_slow_to_time_quickly_gets_the_fixed_lookup_cost(monkeypatch):
    from speclens.engine import session
    from speclens.engine.decoding.drafter import StepCost

    target = CachedModel(tiny_llama(seed=0))
    measured = session.measure_lookup_cost(target)
    assert len(measured.costs) == session.LOOKUP_COST_TOKENS and target.cached_ids == []  # timed, cache left empty
    monkeypatch.setattr(session, "LOOKUP_TIMING_LIMIT_S", 0.0)  # any forward is too slow now
    assert session.measure_lookup_cost(target) == StepCost.linear(session.LOOKUP_CPU_STEP_ROWS)
    assert target.cached_ids == []


def test_pick_threads_keeps_the_fastest_count(engine, monkeypatch):
    """--threads auto: plain decoding is timed at each thread count tried, and the fastest is kept (the
    timings are fixed here: 2 threads the fastest, as on a busy machine where all cores lose)."""
    from speclens.engine.tools import bench
    from speclens.engine.tools.bench import Run

    seconds_per_token = {1: 0.010, 2: 0.004}
    monkeypatch.setattr(bench.os, "cpu_count", lambda: 4)

    def timed(engine, method, ids, options, seed, max_new):
        threads = torch.get_num_threads()
        return Run(method, -1, "", (1,) * max_new, max_new * seconds_per_token.get(threads, 0.020), max_new)

    monkeypatch.setattr(bench, "run_ours", timed)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        rates = bench.pick_threads(engine, [1, 2, 3])
        assert set(rates) == {1, 2, 4} and rates[2] == pytest.approx(250.0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_markdown_flags_a_category_whose_output_differs_from_plain_decoding():
    from speclens.engine.tools.bench import BenchReport, MethodResult

    def result(equal):
        return MethodResult(100.0, 1.0, 1.5, equal, (0.5,), 10, 0.1)

    settings = {"target": "t", "draft": "", "num_prompts": 2, "max_new_tokens": 8, "k": 4, "temperature": 0.0}
    report = BenchReport({"ar": result(True), "lookup": result(False)},
                         {"code": {"ar": result(True), "lookup": result(False)}, "copy": {"ar": result(True),
                                                                                          "lookup": result(True)}},
                         settings, "cpu")
    rows = {line.split(" |")[0]: line for line in markdown(report).splitlines() if line.startswith("| c")}
    assert "NOT EQUAL" in rows["| code"] and "NOT EQUAL" not in rows["| copy"]
    assert "| lookup | 100.0 | 1.00x | 1.50 | NO |" in markdown(report)


# --- kernel agreement and the llama.cpp peer ---


def test_kernel_agreement_is_one_against_itself_and_below_one_against_another_model():
    from speclens.engine.tools.bench import kernel_agreement

    model, other = tiny_llama(seed=0), tiny_llama(seed=3)
    texts = [tiny_tokenizer()(p.turns[0])["input_ids"] for p in PROMPTS]
    same = kernel_agreement(model, model, texts)
    assert same["positions"] == sum(len(t) - 1 for t in texts)
    assert same["top1_agreement"] == 1.0 and same["perplexity"] == same["reference_perplexity"]
    with torch.no_grad():  # a peer's logits handed in as rows (llama.cpp's), one [T - 1, V] per text
        rows = [model(torch.tensor([t])).logits[0, :-1] for t in texts]
    assert kernel_agreement(None, model, texts, rows)["top1_agreement"] == 1.0
    apart = kernel_agreement(model, other, texts)
    assert apart["top1_agreement"] < 0.5 and apart["perplexity"] != apart["reference_perplexity"]


def test_kernel_agreement_of_the_integer_kernels_with_float32_on_a_quantised_model():
    from speclens.engine.runtime.models import _use_cpu_kernels
    from speclens.engine.tools.bench import kernel_agreement
    from tests.native import integer_or_skip
    from tests.tiny import tiny_quantised_llama

    integer_or_skip()
    integer, floats = tiny_quantised_llama(seed=0), tiny_quantised_llama(seed=0)
    _use_cpu_kernels(integer, "integer", torch.float32, lambda *a: None)
    _use_cpu_kernels(floats, "native", torch.float32, lambda *a: None)
    texts = [tiny_tokenizer()(p.turns[0])["input_ids"] for p in PROMPTS]
    result = kernel_agreement(integer, floats, texts)
    assert result["top1_agreement"] >= 0.9  # 8-bit activations move a near-tie now and then, no more
    # this random model's logits are so peaked that perplexity is astronomic: compare the mean NLLs (logs)
    assert abs(math.log(result["perplexity"]) / math.log(result["reference_perplexity"]) - 1) < 0.01
    assert result["perplexity"] != result["reference_perplexity"]  # two kernels really ran


def test_llama_cpp_is_refused_in_one_line_where_it_cannot_run(engine, monkeypatch):
    import speclens.engine.tools.peers as peers

    with pytest.raises(ValueError, match="llama_cpp not available here: .*"):
        run_bench(engine, PROMPTS, BenchOptions(methods=("llama_cpp",), max_new_tokens=4))
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: object())  # installed, but
    assert "tiny-target is not one" in peers.llama_cpp_problem(engine)  # the tiny target has no GGUF file


def test_llama_cpp_runs_in_the_bench_and_its_equality_with_ours_is_reported(engine, monkeypatch):
    """The peer's plumbing, on a stand-in for llama.cpp that decodes with the tiny target itself: its
    tokens are compared with ours like any method's, and a peer that answers otherwise is flagged."""
    import speclens.engine.tools.bench as bench

    class StandIn:
        wrong = False

        def generate(self, ids, max_new, eos_ids):
            tokens = hf_greedy(engine.target.model, ids, max_new)
            return (tuple(t + 1 for t in tokens) if self.wrong else tuple(tokens)), 0.01

    peer = StandIn()
    monkeypatch.setattr(bench, "llama_cpp_problem", lambda engine: None)
    monkeypatch.setattr(bench, "llama_cpp_peer", lambda engine, threads, n_ctx: peer)
    report = run_bench(engine, PROMPTS, BenchOptions(methods=("llama_cpp",), max_new_tokens=12))
    assert set(report.methods) == {"ar", "llama_cpp"} and report.methods["llama_cpp"].equal_to_ar is True
    assert report.methods["llama_cpp"].new_tokens == 12 * len(PROMPTS)
    peer.wrong = True
    report = run_bench(engine, PROMPTS, BenchOptions(methods=("llama_cpp",), max_new_tokens=12))
    assert report.methods["llama_cpp"].equal_to_ar is False
    with pytest.raises(ValueError, match="greedy only"):
        run_bench(engine, PROMPTS, BenchOptions(methods=("llama_cpp",), max_new_tokens=4,
                                                sampling=SamplingParams(temperature=0.7)))


@pytest.mark.slow
def test_llama_cpp_decodes_the_default_gguf_as_we_do():
    """Where llama-cpp-python is installed (the `peers` extra; CI skips this): llama.cpp on the default
    model's own GGUF file, fed our chat template's token ids, gives tokens and a rate."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (pip install -e '.[peers]')")
    from speclens.engine.session import Engine, ModelSettings

    default = Engine.load(ModelSettings())
    report = run_bench(default, PROMPTS[:1], BenchOptions(methods=("llama_cpp",), max_new_tokens=24, warmup=False))
    result = report.methods["llama_cpp"]
    assert result.new_tokens > 0 and result.tokens_per_s > 0
    assert result.equal_to_ar in (True, False)  # reported either way; README's figures say which it was


@pytest.mark.parametrize("flags, words", [(["--threads", "0"], "--threads"), (["--num-prompts", "-1"], "--num-prompts"),
                                          (["--temperature", "nan"], "temperature"), (["--threads", "many"], "many")])
def test_bad_bench_flags_get_one_line_before_any_model_loads(flags, words, capsys):
    from speclens.engine.tools.bench import cmd_bench

    def no_load(_):
        raise AssertionError("a model was loaded")

    assert cmd_bench(build_parser().parse_args(["bench", *flags]), engine_factory=no_load) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error:") and words in error and "\n" not in error


def test_synthetic_methods_run_beside_plain_decoding_and_stay_exact(engine):
    """`synthetic@A` in --methods: the synthetic drafter over the target's own greedy answer; a = 1 accepts
    every drafted token (K + 1 a step), a = 0 none (one a step), and both give plain decoding's tokens."""
    report = run_bench(engine, PROMPTS[:2], BenchOptions(methods=("synthetic@1.0", "synthetic@0"), max_new_tokens=16,
                                                         k=3, warmup=False))
    assert list(report.methods) == ["ar", "synthetic@1.0", "synthetic@0"]
    for name in ("synthetic@1.0", "synthetic@0"):
        assert report.methods[name].equal_to_ar is True and report.methods[name].identical_share == 1.0
    assert report.methods["synthetic@1.0"].tau == pytest.approx(16 / 4)  # 16 tokens in 4 steps of K + 1 = 4
    assert report.methods["synthetic@0"].tau == pytest.approx(1.0)
    assert report.settings["runtime"] == engine.target_lm.runtime == "static-cache forward"
    with pytest.raises(ValueError, match="temperature 0"):
        run_bench(engine, PROMPTS[:1], BenchOptions(methods=("synthetic@0.5",), max_new_tokens=4,
                                                    sampling=SamplingParams(temperature=1.0), warmup=False))


def test_a_method_runs_at_its_own_draft_length_beside_the_others(engine):
    """`draft:1` beside `draft` at -k 3: the same method at K = 1 drafts one token a step, stays exact, and
    is reported under its own name; a length out of range is refused in one line."""
    report = run_bench(engine, PROMPTS[:2], BenchOptions(methods=("draft", "draft:1"), max_new_tokens=16, k=3,
                                                         warmup=False))
    assert list(report.methods) == ["ar", "draft", "draft:1"]
    assert report.methods["draft:1"].equal_to_ar is True
    assert len(report.methods["draft:1"].per_position_acceptance) == 1
    assert len(report.methods["draft"].per_position_acceptance) == 3
    with pytest.raises(ValueError, match="draft length from 1"):
        run_bench(engine, PROMPTS[:1], BenchOptions(methods=("draft:0",), max_new_tokens=4, warmup=False))


@pytest.mark.parametrize("method", ["synthetic@", "synthetic@1.5", "synthetic@x"])
def test_malformed_synthetic_methods_get_one_line(method, capsys):
    from speclens.engine.tools.bench import cmd_bench

    def no_load(_):
        raise AssertionError("a model was loaded")

    assert cmd_bench(build_parser().parse_args(["bench", "--methods", method]), engine_factory=no_load) == 2
    error = capsys.readouterr().err.strip()
    assert "synthetic@0.8" in error and "\n" not in error


def test_a_differing_output_is_explained_with_the_targets_probabilities(engine, monkeypatch):
    """The bench says where an output first differs from plain decoding and how close the target's two
    choices were there; the identical share counts the prompts that agree."""
    from speclens.engine.tools import bench

    real = bench.run_ours

    def flip_one(engine_, method, ids, options, seed, max_new):  # a method whose 6th token differs on prompt 1
        run = real(engine_, method, ids, options, seed, max_new)
        if method == "lookup" and ids == engine_.encode_chat([{"role": "user", "content": PROMPTS[1].turns[0]}]):
            tokens = list(run.tokens)
            tokens[5] = (tokens[5] + 1) % engine_.target_lm.n_vocab
            run = bench.replace(run, tokens=tuple(tokens))
        return run

    monkeypatch.setattr(bench, "run_ours", flip_one)
    report = run_bench(engine, PROMPTS[:2], BenchOptions(methods=("lookup",), max_new_tokens=10, warmup=False))
    lookup = report.methods["lookup"]
    assert lookup.equal_to_ar is False and lookup.identical_share == 0.5
    (note,) = lookup.diverged
    plain = next(r.tokens for r in report.runs if r.method == "ar" and r.prompt == 1)
    ids = engine.encode_chat([{"role": "user", "content": PROMPTS[1].turns[0]}])
    p_target = torch.softmax(CachedModel(engine.target.model).forward(ids + list(plain[:5]), [], 1)[0], -1)
    assert note == (f"prompt 1: diverged at token 5: near-tie of p={p_target[plain[5]]:.4f} (plain's token) vs "
                    f"p={p_target[(plain[5] + 1) % engine.target_lm.n_vocab]:.4f} (this method's)")
    assert "NO (50% identical)" in markdown(report) and note in markdown(report)
