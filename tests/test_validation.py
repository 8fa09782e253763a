"""Bad input never reaches a traceback: one validation of every setting, prompts (invalid bytes, empty,
longer than the context), cancellable chunked prefill, Ctrl-C at start-up."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from speclens.engine.decoding.decode import GenerationConfig, generate
from speclens.engine.decoding.events import Summary, TokenEvent
from speclens.engine.decoding.limits import KNOWN_METHODS, MAX_K, SettingError
from speclens.engine.decoding.prompt import PromptError, clean_text, decode_bytes, fit_ids, fit_turns
from speclens.engine.decoding.sampling import SamplingParams
from speclens.engine.runtime.cache import CachedModel
from speclens.engine.session import EngineError, ModelSettings
from speclens.engine.tools.cli import build_parser, main, preflight_generate
from tests.tiny import make_tiny_engine, tiny_llama, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]

anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=12), st.binary(max_size=4), st.lists(st.integers(), max_size=2),
)
numbers = st.one_of(st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=400, deadline=None)
@given(temperature=numbers, top_k=anything, top_p=numbers, penalty=anything)
def test_sampling_params_are_valid_or_one_setting_error(temperature, top_k, top_p, penalty):
    try:
        params = SamplingParams(temperature, top_k, top_p, penalty)
    except SettingError as exc:
        assert "\n" not in str(exc) and str(exc).split()[0] in ("temperature", "top_k", "top_p", "repetition_penalty")
        return
    assert math.isfinite(params.temperature) and 0 <= params.temperature <= 100
    assert 0 < params.top_p <= 1 and math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0
    assert isinstance(params.top_k, int) and params.top_k >= 0


@settings(max_examples=300, deadline=None)
@given(method=anything, k=anything, max_new=anything, seed=anything, stops=anything, adaptive=anything)
def test_generation_configs_are_valid_or_one_setting_error(method, k, max_new, seed, stops, adaptive):
    try:
        config = GenerationConfig(method=method, k=k, max_new_tokens=max_new, seed=seed, stop_strings=stops,
                                  adaptive_k=adaptive)
    except SettingError as exc:
        assert "\n" not in str(exc)
        return
    assert 1 <= config.k <= MAX_K and config.max_new_tokens >= 1 and isinstance(config.method, str)


@settings(max_examples=300, deadline=None)
@given(target=anything, device=anything, dtype=anything, kernels=anything, budget=anything, trust=anything)
def test_model_settings_are_valid_or_one_setting_error(target, device, dtype, kernels, budget, trust):
    try:
        ModelSettings(target=target, device=device, dtype=dtype, cpu_kernels=kernels, tree_budget=budget,
                      trust_remote_code=trust)
    except SettingError as exc:
        assert "\n" not in str(exc)


FLAG_VALUES = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e308", "1e-320", "0", "-1", "17", "4", "0.5",
                                         "", "abc", "2**70", "9" * 30, "ar", "eagle", "cuda:0", "cpu"]),
                        st.text(max_size=8))
FLAGS = ["--temperature", "--top-k", "--top-p", "--repetition-penalty", "-k", "--max-new-tokens", "--seed",
         "--method", "--device", "--tree-budget", "--dtype", "--cpu-kernels", "--context-overflow"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FLAGS), FLAG_VALUES), max_size=4))
def test_the_command_line_gives_a_config_or_a_usage_error_or_one_setting_error(flags):
    argv = ["generate", "--prompt", "hi"] + [part for flag, value in flags for part in (flag, value)]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: a usage line and one error line, exit 2
        assert exc.code == 2
        return
    try:
        config = preflight_generate(args)
    except SettingError as exc:
        assert "\n" not in str(exc)
        return
    assert isinstance(config, GenerationConfig)


def test_refusals_name_the_setting_and_its_range():
    with pytest.raises(SettingError, match=r"temperature must be in 0\.\.100 \(0 is greedy\), got nan"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(SettingError, match=r"draft length k must be in 1\.\.16, got 17"):
        GenerationConfig(k=17)
    with pytest.raises(SettingError, match="whole number"):
        GenerationConfig(k=4.5)
    with pytest.raises(SettingError, match="tree budget must be in 1..128 nodes, got 0"):
        ModelSettings(tree_budget=0)
    with pytest.raises(SettingError, match="device must be"):
        ModelSettings(device="gpu")


@pytest.mark.parametrize("argv, words", [
    (["--temperature", "nan"], "temperature must be in"),
    (["--temperature", "inf"], "temperature must be in"),
    (["--repetition-penalty", "nan"], "repetition_penalty must be in"),
    (["-k", "0"], "draft length k must be in 1..16"),
    (["--max-new-tokens", "0"], "max_new_tokens must be in"),
    (["--method", "nonsense"], "method must be one of"),
    (["--method", "draft"], "--method draft needs --draft"),
    (["--tree-budget", "500"], "tree budget must be in 1..128"),
    (["--device", "gpu"], "device must be"),
    (["--system", "be brief"], "--system needs --chat"),
])
def test_bad_settings_exit_2_with_one_line_before_any_model_loads(argv, words, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("speclens.engine.tools.cli.load_engine", no_loading)
    assert main(["generate", "--target", "/nowhere/at/all", "--prompt", "hi", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


def test_bench_refuses_unknown_methods_before_loading(capsys):
    def no_loading(args):
        raise AssertionError("a model was loaded")

    from speclens.engine.tools.bench import cmd_bench

    args = build_parser().parse_args(["bench", "--methods", "ar,warp_drive"])
    assert cmd_bench(args, engine_factory=no_loading) == 2
    assert "unknown warp_drive" in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    model = tiny_llama(seed=0)
    model.config.max_position_embeddings = 96  # a context small enough to overflow in a test
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_an_empty_prompt_is_refused_before_loading(capsys, monkeypatch):
    monkeypatch.setattr("speclens.engine.tools.cli.load_engine", lambda args: pytest.fail("loaded"))
    assert main(["generate", "--prompt", ""]) == 2
    assert main(["generate", "--prompt", "  \n"]) == 2
    assert capsys.readouterr().err.count("error: the prompt is empty") == 2


def test_invalid_bytes_become_replacement_characters_with_a_warning(model_folder, capsys):
    assert clean_text("ab\udcff\udcfec") == ("ab\ufffd\ufffdc", 2)  # argv's surrogateescape of 0xff 0xfe
    assert decode_bytes(b"ok \xff\xfe then \xef\xbf\xbd") == ("ok \ufffd\ufffd then \ufffd", 2)
    assert decode_bytes("héllo".encode()) == ("héllo", 0)
    assert main(["generate", "--target", str(model_folder), "--prompt", "one \udcff two", "--max-new-tokens", "3",
                 "--jsonl"]) == 0
    captured = capsys.readouterr()
    assert "warning: 1 invalid byte sequence in --prompt replaced by \ufffd" in captured.err
    assert '"type": "summary"' in captured.out.splitlines()[-1]


def test_invalid_bytes_on_standard_input(model_folder):
    run = subprocess.run([sys.executable, "-m", "speclens.app", "generate", "--target", str(model_folder),
                          "--max-new-tokens", "2", "--jsonl"], input=b"one \xff\xfe two", capture_output=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr.decode()
    assert b"2 invalid byte sequences in standard input" in run.stderr and b"Traceback" not in run.stderr


def test_turns_are_dropped_oldest_first_keeping_the_system_prompt_and_the_last_turn():
    def encode(messages):  # one token per character of content, plus one per message
        return [0] * sum(len(m["content"]) + 1 for m in messages)

    messages = [{"role": "system", "content": "s" * 9}, {"role": "user", "content": "a" * 30},
                {"role": "assistant", "content": "b" * 30}, {"role": "user", "content": "c" * 9}]
    fitted = fit_turns(messages, encode, context=110, max_new_tokens=20, policy="drop_oldest")
    assert fitted.dropped == 0 and fitted.notice is None and fitted.tokens == 82
    fitted = fit_turns(messages, encode, context=80, max_new_tokens=20, policy="drop_oldest")
    # a user turn goes with the answer after it: the roles still alternate (templates require it)
    assert fitted.dropped == 2 and fitted.tokens == 10 + 10 and "Dropped the 2 oldest turns" in fitted.notice
    longer = messages[:3] + [{"role": "user", "content": "d" * 9}, {"role": "assistant", "content": "e" * 9}] + \
        messages[3:]
    seen = []
    fitted = fit_turns(longer, lambda m: seen.append([x["role"] for x in m]) or encode(m), context=80,
                       max_new_tokens=20, policy="drop_oldest")
    assert fitted.dropped == 2 and seen[-1] == ["system", "user", "assistant", "user"]
    with pytest.raises(PromptError, match="The conversation is 82 tokens.*context holds 80"):
        fit_turns(messages, encode, context=80, max_new_tokens=20, policy="stop")
    with pytest.raises(PromptError, match="The last message"):
        fit_turns(messages, encode, context=24, max_new_tokens=20, policy="drop_oldest")
    assert fit_ids(list(range(100)), 64, 8, "drop_oldest").ids == tuple(range(44, 100))
    assert fit_ids(list(range(100)), 64, 8, "drop_oldest", keep_first=1).ids == (0, *range(45, 100))  # BOS stays
    with pytest.raises(PromptError, match="The prompt is 100 tokens"):
        fit_ids(list(range(100)), 64, 8, "stop")


def test_a_prompt_past_the_context_stops_with_a_message_or_keeps_the_newest_tokens(model_folder, capsys):
    long_prompt = " ".join(["one two three"] * 40)  # far past the 96 positions
    base = ["generate", "--target", str(model_folder), "--prompt", long_prompt, "--max-new-tokens", "8", "--jsonl"]
    assert main(base) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]  # after loading's
    assert len(errors) == 1 and "context holds 96" in errors[0] and "drop_oldest" in errors[0]
    assert main([*base, "--context-overflow", "drop_oldest"]) == 0
    captured = capsys.readouterr()
    assert "note: Dropped the first" in captured.err and '"new_tokens": 8' in captured.out.splitlines()[-1]


def test_decoding_stops_at_the_end_of_the_context():
    engine = make_tiny_engine(draft=True)
    engine.target_lm.context_length = 40
    ids = engine.encode_text("one two three four")
    for method in ("ar", "draft", "lookup"):
        events = list(engine.generate_ids(ids, GenerationConfig(method=method, k=4, max_new_tokens=200)))
        summary = events[-1]
        assert summary.stop_reason == "context_full" and len(ids) + summary.new_tokens == 40, method


def test_chunked_prefill_holds_what_one_forward_holds_and_stops_between_chunks():
    model = tiny_llama(seed=0)
    ids = [1 + (7 * i) % 90 for i in range(50)]
    whole, chunked = CachedModel(model), CachedModel(model)
    whole.keep_hidden = chunked.keep_hidden = True
    whole.prefill(ids, chunk=10_000)
    assert chunked.prefill(ids, chunk=8)
    assert chunked.cached_ids == whole.cached_ids == ids[:-1]
    assert chunked.hidden_at(0, 49).shape == whole.hidden_at(0, 49).shape
    torch.testing.assert_close(chunked.hidden_at(0, 49), whole.hidden_at(0, 49), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(chunked.forward(ids, [], 1), whole.forward(ids, [], 1), atol=1e-5, rtol=1e-4)

    asked = []
    stopped = CachedModel(model)

    def stop() -> bool:
        asked.append(len(stopped.cached_ids))
        return len(asked) > 2

    assert stopped.prefill(ids, stop=stop, chunk=8) is False
    assert asked == [0, 8, 16] and stopped.cached_ids == ids[:16]


def test_stop_during_prefill_ends_the_generation_before_any_token():
    engine = make_tiny_engine(draft=False)
    cancel = threading.Event()
    calls = []
    original = engine.target_lm.forward

    def forward(context, block, n_logits):
        calls.append(len(context))
        cancel.set()  # Stop pressed while the first chunk runs
        return original(context, block, n_logits)

    engine.target_lm.forward = forward
    ids = [1 + i % 90 for i in range(600)]
    events = list(engine.generate_ids(ids, GenerationConfig(method="ar", max_new_tokens=8), cancel))
    assert len(calls) == 1 and not any(isinstance(e, TokenEvent) for e in events)
    assert isinstance(events[-1], Summary) and events[-1].stop_reason == "cancelled"


def test_engine_api_cleans_invalid_text_and_checks_the_policy():
    engine = make_tiny_engine(draft=False)
    assert engine.encode_text("one \udcff") == engine.encode_text("one \ufffd")
    with pytest.raises(SettingError, match="context overflow policy"):
        engine.fit_text("one", 8, policy="truncate_middle")
    engine.target_lm.context_length = 16
    with pytest.raises(EngineError, match="context holds 16"):
        engine.fit_chat([{"role": "user", "content": "one two three " * 20}], 8)


@pytest.mark.skipif(not hasattr(signal, "SIGINT") or os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize("delay_s", [0.3, 1.0, 1.5, 2.0, 2.5])
def test_ctrl_c_at_start_up_exits_130_without_a_traceback(delay_s, model_folder):
    proc = subprocess.Popen([sys.executable, "-m", "speclens.app", "generate", "--target", str(model_folder),
                             "--prompt", "hi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(delay_s)  # inside the imports, or the model's load
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in err and b"Traceback" not in err


def test_setting_error_is_a_value_error():  # callers that caught ValueError keep working
    assert issubclass(SettingError, ValueError) and set(KNOWN_METHODS) >= {"ar", "lookup", "eagle_lookup"}
    assert isinstance(build_parser(), argparse.ArgumentParser)


@pytest.mark.parametrize("argv, words", [
    (["train-drafter", "--kind", "eagle", "--prompts", "p.jsonl", "--out", "o", "--epochs", "-1"], "--epochs must be"),
    (["train-drafter", "--kind", "eagle", "--prompts", "p.jsonl", "--out", "o", "--lr", "nan"], "--lr must be"),
    (["train-drafter", "--kind", "medusa", "--prompts", "p.jsonl", "--out", "o", "--batch-size", "0"],
     "--batch-size must be"),
    (["train-drafter", "--kind", "eagle", "--prompts", "/no/such/prompts.jsonl", "--out", "o"], "prompts.jsonl"),
    (["selftest", "--trials", "0"], "--trials must be in"),
])
def test_the_other_commands_refuse_bad_values_in_one_line(argv, words, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("speclens.engine.tools.cli.load_engine", lambda args: pytest.fail("loaded"))
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("error: ") and words in errors[0], errors
