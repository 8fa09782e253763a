"""Compare mode, Stop, load failures, and the headless entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from PySide6.QtGui import QImage

from speclens.app.main import parse_args
from speclens.app.settings import AppSettings
from speclens.engine.decoding.advisor import advise_steps
from speclens.engine.session import EngineError
from tests.app_fixtures import app_dirs, make_window, record_requests, send_and_wait, tiny_factory  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]


def _compare(qtbot, window, settings: AppSettings, prompt: str = "Count: one two three"):
    """Apply settings, run a comparison and return its CompareResult."""
    window.apply_settings(settings)
    with qtbot.waitSignal(window.compare.finished, timeout=60_000) as blocker:
        window.run_compare(prompt)
    window.compare.finish_replay()  # the race's end, at once
    return blocker.args[0]


def test_compare_fills_both_panes_and_reports_identical_at_temperature_zero(qtbot, make_window):
    window = make_window(tiny_factory())
    result = _compare(qtbot, window, AppSettings(method="draft", draft="tiny", k=3, temperature=0.0, max_new_tokens=30))
    left, right = window.compare.left, window.compare.right
    assert len(left.tokens) == len(right.tokens) == 30
    assert {t.source for t in left.tokens} == {"target"}
    assert {t.source for t in right.tokens} - {"target"}  # drafted tokens appear on the right
    assert left.view.toPlainText() == right.view.toPlainText() != ""
    assert result.error == "" and result.diff is not None and result.diff.identical
    assert result.baseline.method == "ar" and result.speculative.method == "draft"
    assert result.speedup is not None and result.speedup > 0
    assert "identical" in window.compare.result.text()
    # adaptive K (the default) is used by the comparison too, and the outputs still match
    steps = result.speculative_steps
    assert len({s.k for s in steps if 30 - (s.new_tokens - s.emitted) - 1 >= 3}) > 1, [s.k for s in steps]
    # predicted vs measured speedup, the prediction read off the engine's advisor
    assert window._loaded.verify_shape is not None
    expected = advise_steps(steps, 16, window._loaded.verify_shape)
    assert result.advice == expected
    assert result.predicted_speedup == pytest.approx(expected.speedup[result.predicted_k - 1])
    assert "predicted" in window.compare.result.text() and "measured" in window.compare.result.text()
    # the comparison feeds the plot panel with the speculative run
    assert window.plots.steps == steps
    assert list(window.plots._k_curve.getData()[1]) == [s.k for s in steps]
    assert "draft" in window.plots.summary.text()


def test_compare_times_interleaved_runs_quietly_then_races_the_median_ones(qtbot, make_window):
    window = make_window(tiny_factory(step_delay_s=0.01))
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, temperature=0.0, max_new_tokens=24,
                                      compare_runs=3))
    sent = record_requests(window)
    compare = window.compare
    drawn_while_timed = []
    with qtbot.waitSignal(compare.finished, timeout=60_000) as blocker:
        window.run_compare("Count: one two three")
        qtbot.waitUntil(lambda: len(compare.left.tokens) >= 3, timeout=30_000)
        drawn_while_timed.append(compare.left.view.toPlainText() + compare.right.view.toPlainText())
    result = blocker.args[0]
    assert drawn_while_timed == [""]  # no text is drawn while a run is timed
    assert [r.config.method for r in sent] == ["ar", "draft"] * 3  # interleaved pairs
    assert result.runs == 3 and len(result.speedups) == 3 and result.diff.identical
    assert "median of 3 runs each" in compare.result.text() and "first token" in compare.result.text()
    # the race: tokens appear when the step that made them ended, on one clock for both sides
    assert compare.replaying
    base, spec = compare._chosen
    t = spec.steps[len(spec.steps) // 2].elapsed_s
    compare._replay.stop()
    compare._show_at(t)
    made_by_t = [tok for tok in spec.tokens if next(s.elapsed_s for s in spec.steps if s.step == tok.step) <= t]
    assert compare.right.tokens == made_by_t and 0 < len(made_by_t) < len(spec.tokens)
    assert compare.right.speed.text().startswith(f"{t:.2f} s · ")
    compare.finish_replay()
    assert compare.left.tokens == base.tokens and compare.right.tokens == spec.tokens
    assert compare.left.view.toPlainText() == compare.right.view.toPlainText() != ""
    assert compare.right.speed.text().startswith("✓ ") and "first token" in compare.right.speed.text()
    assert result.speedup == pytest.approx(spec.summary.tokens_per_s / base.summary.tokens_per_s)
    rates = sorted(r.summary.tokens_per_s for r in compare._runs.values() if r.side == "plain")
    assert base.summary.tokens_per_s == rates[1]  # the median run


def test_compare_gives_no_chain_prediction_for_a_tree_method(qtbot, make_window):
    window = make_window(tiny_factory())
    result = _compare(qtbot, window, AppSettings(method="tree", draft="tiny", k=3, temperature=0.0, max_new_tokens=20))
    assert result.error == "" and result.speculative.method == "tree" and result.diff.identical
    assert result.speculative_steps and all(s.tree for s in result.speculative_steps)
    assert result.advice is None and result.predicted_speedup is None
    text = window.compare.result.text()
    assert "no prediction (token trees" in text and "measured" in text


def test_compare_names_the_method_that_ran_not_auto(qtbot, make_window):
    window = make_window(tiny_factory())
    result = _compare(qtbot, window, AppSettings(method="auto", temperature=0.0, max_new_tokens=12))
    ran = result.speculative.method
    assert result.error == "" and ran not in ("auto", "ar") and ran in window._loaded.methods
    assert window.compare.right.title.text().startswith(f"Speculative ({ran}, ")


def test_the_system_prompt_opens_every_chat_and_comparison(qtbot, make_window):
    window = make_window(tiny_factory(), settings=AppSettings(method="lookup", max_new_tokens=6,
                                                              system_prompt="Answer in French."))
    sent = record_requests(window)
    send_and_wait(qtbot, window, "one two")
    send_and_wait(qtbot, window, "three")
    _compare(qtbot, window, replace(window.settings, system_prompt="Be brief.", compare_runs=1), "four")
    system = [r.messages[0] for r in sent]
    assert system == [("system", "Answer in French.")] * 2 + [("system", "Be brief.")] * 2
    assert [role for role, _ in sent[1].messages] == ["system", "user", "assistant", "user"]
    stored = window.history.messages(window._conversation_id)
    assert [m.role for m in stored] == ["user", "assistant", "user", "assistant"]  # the history keeps turns only


def test_compare_marks_differences(qtbot, make_window):
    from speclens.app.stats import diff_tokens

    window = make_window(tiny_factory())
    pane = window.compare.left
    window.compare.left.reset()
    from speclens.engine.decoding.events import TokenEvent

    pane.append([TokenEvent(i, f"t{i} ", "target", i, 0, 0.5, None) for i in range(4)])
    diff = diff_tokens([0, 1, 2, 3], [0, 1, 7, 3])
    pane.mark(diff.left_changed)
    from PySide6.QtGui import QTextCursor

    cursor = QTextCursor(pane.view.document())
    cursor.setPosition(len("t0 t1 ") + 1)
    assert cursor.charFormat().underlineStyle().name == "WaveUnderline"
    cursor.setPosition(1)
    assert cursor.charFormat().underlineStyle().name == "NoUnderline"


def test_compare_says_how_close_the_target_was_where_outputs_differ():
    """A greedy divergence shown with the target's probability of both sides' tokens there."""
    from speclens.app.compare import _Run, near_tie
    from speclens.app.stats import diff_tokens
    from speclens.engine.decoding.events import TokenEvent

    def run(side, ids, probs):
        return _Run(side, 1, [TokenEvent(t, f"t{t}", "target", i, i, p, None) for i, (t, p) in enumerate(zip(ids, probs))])

    plain, spec = run("plain", [5, 6, 7], [0.9, 0.412, 0.8]), run("speculative", [5, 8, 7], [0.9, 0.409, 0.7])
    assert near_tie(plain, spec, diff_tokens([5, 6, 7], [5, 8, 7])) == (
        ": the target gave p=0.412 to plain's token, p=0.409 to this one")
    assert near_tie(plain, plain, diff_tokens([5, 6, 7], [5, 6, 7])) == ""
    assert near_tie(plain, run("speculative", [5, 6], [0.9, 0.4]), diff_tokens([5, 6, 7], [5, 6])) == ""


def test_stop_ends_generation_within_one_step(qtbot, make_window):
    engines = []

    def factory(settings, progress):
        engine = tiny_factory(step_delay_s=0.05)(settings, progress)
        engines.append(engine)
        return engine

    window = make_window(factory)
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, max_new_tokens=1000))
    window.send_message("go on for a while")
    qtbot.waitUntil(lambda: len(window.plots.steps) >= 3 or len(window._answer.steps) >= 3, timeout=30_000)
    with qtbot.waitSignal(window.answer_finished, timeout=5_000) as blocker:
        qtbot.mouseClick(window.stop_button, __import__("PySide6.QtCore").QtCore.Qt.MouseButton.LeftButton)
    message = blocker.args[0]
    assert engines[0].steps_after_cancel <= 1
    assert 0 < len(message.tokens) < 1000
    assert message.error == "(stopped)"
    assert window.send_button.isEnabled() and not window.stop_button.isEnabled()


def test_escape_stops_the_answer_and_then_the_comparison(qtbot, make_window):
    from PySide6.QtCore import Qt

    window = make_window(tiny_factory(step_delay_s=0.05),
                         settings=AppSettings(method="draft", draft="tiny", k=3, max_new_tokens=1000))
    window.show()
    qtbot.waitExposed(window)
    window.input.setFocus()
    window.send_message("go on for a while")
    qtbot.waitUntil(lambda: len(window._answer.tokens) >= 3, timeout=30_000)
    with qtbot.waitSignal(window.answer_finished, timeout=10_000) as stopped:
        qtbot.keyClick(window.input, Qt.Key.Key_Escape)
    assert stopped.args[0].error == "(stopped)" and 0 < len(stopped.args[0].tokens) < 1000
    with qtbot.waitSignal(window.compare.finished, timeout=60_000) as compared:
        window.run_compare("count for a while")
        qtbot.waitUntil(lambda: len(window.compare.left.tokens) >= 3, timeout=30_000)
        window.compare.prompt.setFocus()
        qtbot.keyClick(window.compare.prompt, Qt.Key.Key_Escape)
    result = compared.args[0]  # Esc stops both runs: the plain one mid-way, the speculative one before it starts
    assert result.stopped and result.error == "" and result.speculative is None
    assert result.baseline.stop_reason == "cancelled" and len(window.compare.left.tokens) < 1000
    assert window.compare.result.text() == "Stopped before both runs finished: nothing to compare."
    assert window.plots.summary.text() == "Comparison stopped"


def test_failed_load_shows_an_error_and_the_window_keeps_working(qtbot, make_window):
    def factory(settings, progress):
        if settings.target == "nowhere/nothing":
            raise EngineError("Model 'nowhere/nothing' was not found on disk or in the cache.")
        return tiny_factory()(settings, progress)

    window = make_window(factory, settings=AppSettings(target="nowhere/nothing", method="lookup", max_new_tokens=6))
    message = send_and_wait(qtbot, window, "hello?")
    assert message.error and not message.tokens
    assert window.error_banner.isVisible() and "not found" in window.error_banner.text()
    assert window.status_model.text() == "Model failed to load"
    assert window.send_button.isEnabled()

    window.apply_settings(AppSettings(target="default", method="lookup", max_new_tokens=6))
    message = send_and_wait(qtbot, window, "and now?")
    assert message.error == "" and len(message.tokens) == 6
    assert not window.error_banner.isVisible()
    assert "tiny-target" in window.status_model.text()


HEADLESS = (
    "import sys; from app.main import main; from tests.app_fixtures import tiny_factory; "
    "sys.exit(main(sys.argv[1:], engine_factory=tiny_factory()))"
)


@pytest.mark.parametrize("compare", [False, True])
def test_headless_main_saves_a_screenshot_and_exits_zero(app_dirs, tmp_path, compare):
    """The real entry point (qasync loop, flags) in its own process, on the tiny engine."""
    config, _ = app_dirs
    config.mkdir(parents=True, exist_ok=True)
    (config / "settings.toml").write_text('draft = "tiny"\n')  # --method draft needs a draft model set
    out, settings_out = tmp_path / "shot.png", tmp_path / "settings.png"
    argv = ["--prompt", "one two three", "--method", "draft", "-k", "3", "--max-new-tokens", "24",
            "--screenshot", str(out), "--screenshot-settings", str(settings_out)]
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    run = subprocess.run(
        [sys.executable, "-c", HEADLESS, *argv, *(["--compare"] if compare else [])],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.stat().st_size > 10_000
    image = QImage(str(out))
    assert image.width() >= 1200 and image.height() >= 800
    dialog = QImage(str(settings_out))  # the settings dialog with the advisor's curve
    assert dialog.width() >= 800 and settings_out.stat().st_size > 10_000


def test_headless_main_fails_with_a_message(app_dirs, tmp_path):
    failing = HEADLESS.replace("tiny_factory()", "failing_factory()").replace("import tiny_factory", "import failing_factory")
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    run = subprocess.run(
        [sys.executable, "-c", failing, "--prompt", "hi", "--screenshot", str(tmp_path / "x.png")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1
    assert "No such model" in run.stderr


def test_parse_args():
    args = parse_args(["--prompt", "hi", "--compare", "--screenshot", "x.png", "--method", "draft", "-k", "5"])
    assert (args.prompt, args.compare, args.method, args.k, args.adaptive_k) == ("hi", True, "draft", 5, None)
    assert parse_args(["--method", "medusa", "--no-adaptive-k"]).method == "medusa"  # checked after load
    assert parse_args(["--no-adaptive-k"]).adaptive_k is False
    with pytest.raises(SystemExit):
        parse_args(["-k", "40"])


def test_headless_main_rejects_a_method_the_models_do_not_offer(app_dirs, tmp_path):
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    run = subprocess.run(
        [sys.executable, "-c", HEADLESS, "--prompt", "hi", "--method", "medusa", "--max-new-tokens", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 1
    assert "'medusa' is not available" in run.stderr and "ar, lookup, draft, tree" in run.stderr


def _loading_until(release, progress_every_s: float | None):
    """A model load that lasts until `release` is set (or 60 s), reporting progress every
    `progress_every_s` seconds (None: never, like a long step of a real load)."""
    import time

    def factory(settings, progress):
        progress("Loading a big model", None)
        deadline = time.monotonic() + 60
        while not release.is_set() and time.monotonic() < deadline:
            time.sleep(progress_every_s or 0.05)
            if progress_every_s is not None:
                progress("Loading a big model", None)
        return tiny_factory()(settings, progress)

    return factory


def test_closing_during_a_load_stops_it_at_its_next_progress_report(qtbot, make_window):
    import threading

    release = threading.Event()
    window = make_window(_loading_until(release, progress_every_s=0.05), preload=True)
    qtbot.waitUntil(lambda: "Loading a big model" in window.statusBar().currentMessage(), timeout=10_000)
    window.close()
    stopped = not window.engine_thread_running()
    release.set()  # whatever happened, let the fake load end
    assert stopped  # the load raised at its next report; the thread ended and the window could close


CLOSE_DURING_LOAD = (
    "import sys, threading; from PySide6.QtCore import QTimer; from PySide6.QtWidgets import QApplication; "
    "from app.main import main; from tests.test_app_run import _loading_until; "
    "QApplication([]); QTimer.singleShot(1500, lambda: [w.close() for w in QApplication.topLevelWidgets() "
    "if w.windowTitle() == 'SpecLens']); "
    "code = main([], engine_factory=_loading_until(threading.Event(), progress_every_s=None)); "
    "print('main returned', code)"
)


def test_closing_during_a_load_that_cannot_stop_leaves_cleanly(app_dirs):
    """A load between two progress reports cannot be interrupted: the app must not wait for it (the
    fake one never ends) nor destroy its running thread (Qt aborts the process: exit 134)."""
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    run = subprocess.run([sys.executable, "-c", CLOSE_DURING_LOAD], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "main returned" not in run.stdout  # it left at once, without finalising a running thread
    assert "closing while a model load cannot be interrupted" in run.stderr


def test_a_draft_method_without_a_draft_model_is_refused_not_served_by_the_last_one(qtbot, make_window):
    window = make_window(tiny_factory())
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, max_new_tokens=8))
    assert not send_and_wait(qtbot, window, "one two three").error  # the draft model is loaded now
    window.apply_settings(AppSettings(method="draft", draft="", k=3, max_new_tokens=8))
    message = send_and_wait(qtbot, window, "one two three")
    assert "choose a draft model" in message.error and not message.text
    assert not window.busy and window.send_button.isEnabled()


def test_a_comparison_stopped_during_its_last_run_is_not_raced(qtbot, make_window):
    window = make_window(tiny_factory(step_delay_s=0.05))
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, temperature=0.0, max_new_tokens=200,
                                      compare_runs=1, adaptive_k=False))
    compare = window.compare
    with qtbot.waitSignal(compare.finished, timeout=60_000) as blocker:
        window.run_compare("count for a while")
        qtbot.waitUntil(lambda: compare.right.tokens is not compare.left.tokens and len(compare.right.tokens) >= 3,
                        timeout=60_000)
        compare.stop()
    result = blocker.args[0]  # the plain run finished, the speculative one was cut: no false "outputs differ"
    assert result.stopped and result.diff is None and not compare.replaying
    assert compare.result.text() == "Stopped before both runs finished: nothing to compare."
    assert compare.right.speed.text() == "stopped"
