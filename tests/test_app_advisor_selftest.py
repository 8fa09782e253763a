"""Adaptive draft length in chat, the speedup advisor in the settings dialog, the exactness
self-test run from the window, and request ids owned by the worker."""

from __future__ import annotations

import threading

import pytest
from PySide6.QtCore import Qt

from speclens.app.settings import AppSettings, SettingsDialog
from speclens.app.worker import EngineWorker
from speclens.engine.decoding.advisor import advise_steps
from speclens.engine.decoding.decode import next_draft_length
from speclens.engine.decoding.events import StepEvent
from tests.app_fixtures import app_dirs, make_window, send_and_wait, tiny_factory  # noqa: F401 (fixtures)
from tests.broken_samplers import residual_softmax

N_TOKENS = 40


def unclipped(steps, k_max: int):
    """The steps whose K was chosen by the schedule alone, not cut short by max_new_tokens."""
    return [s for s in steps if N_TOKENS - (s.new_tokens - s.emitted) - 1 >= k_max]


def test_adaptive_k_follows_the_schedule_and_the_plot_gets_k_points(qtbot, make_window):
    assert AppSettings().adaptive_k  # on by default
    window = make_window(tiny_factory())
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=4, max_new_tokens=N_TOKENS))
    send_and_wait(qtbot, window, "The capital of France is")
    steps = window.plots.steps
    free = unclipped(steps, 4)
    assert len({s.k for s in free}) > 1, [s.k for s in steps]
    for prev, nxt in zip(steps, steps[1:]):
        if prev in free and nxt in free:
            assert nxt.k == next_draft_length(prev.k, prev.drafted, prev.accepted, 4)
    x, y = window.plots._k_curve.getData()
    assert list(x) == [s.step for s in steps] and list(y) == [s.k for s in steps]
    assert "adaptive" in window.chat.messages[-1].meta and "adaptive" in window.status_k.text()

    # the advisor in the settings dialog measures exactly that answer
    dialog = window.settings_dialog()
    qtbot.addWidget(dialog)
    shape = window._loaded.verify_shape
    assert shape is not None  # a CPU target's timed forwards shape the verify cost
    assert dialog.advisor.advice == advise_steps(steps, 16, shape)

    window.apply_settings(AppSettings(method="draft", draft="tiny", k=4, max_new_tokens=N_TOKENS, adaptive_k=False))
    send_and_wait(qtbot, window, "The capital of France is")
    assert {s.k for s in unclipped(window.plots.steps, 4)} == {4}


def synthetic_steps() -> list[StepEvent]:
    """Acceptance that decays with position, and a verify cost that grows with the block."""
    steps, new_tokens, elapsed = [], 0, 0.0
    for i, (drafted, accepted) in enumerate(
        [(6, 6), (6, 5), (6, 4), (6, 3), (6, 2), (6, 1), (6, 0), (2, 2), (2, 1), (3, 3), (4, 2), (5, 5)]
    ):
        verify_s = 0.020 + 0.004 * (drafted + 1) + 0.0005 * (i % 3)
        new_tokens += accepted + 1
        elapsed += 0.003 * drafted + verify_s
        draft_s = 0.003 * drafted
        steps.append(StepEvent(i + 1, drafted, drafted, accepted, accepted + 1, draft_s, verify_s, new_tokens, elapsed))
    return steps


def test_settings_dialog_advisor_matches_engine_advisor_and_applies_k(qtbot):
    steps = synthetic_steps()
    expected = advise_steps(steps)
    assert expected.best_k not in (1, 2, 16)  # an interior optimum, distinct from the K set below
    dialog = SettingsDialog(AppSettings(k=2), steps=tuple(steps), steps_source="a test answer")
    qtbot.addWidget(dialog)
    advisor = dialog.advisor
    x, y = advisor._curve.getData()
    assert list(x) == list(range(1, 17)) and list(y) == pytest.approx(expected.speedup)
    bx, by = advisor._best.getData()
    assert list(bx) == [expected.best_k]
    assert by[0] == pytest.approx(max(expected.speedup))
    assert f"K = {expected.best_k}" in advisor.label.text() and "a test answer" in advisor.label.text()
    assert advisor.apply.isEnabled() and advisor.apply.text() == f"Use K = {expected.best_k}"
    qtbot.mouseClick(advisor.apply, Qt.MouseButton.LeftButton)
    assert dialog.settings().k == expected.best_k


def test_settings_dialog_says_when_there_is_no_measurement(qtbot):
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    assert dialog.advisor.advice is None and not dialog.advisor.apply.isEnabled()
    assert "No measurement yet" in dialog.advisor.label.text()
    assert len(dialog.advisor._curve.getData()[0] or ()) == 0
    plain = (StepEvent(1, 0, 0, 0, 1, 0.0, 0.01, 1, 0.01),)
    dialog.set_measurement(plain, "a plain answer")
    assert dialog.advisor.advice is None and "drafted nothing" in dialog.advisor.label.text()
    # token trees verify more tokens than K: the chain model is not applied to them
    tree = (StepEvent(1, 4, 4, 3, 4, 0.001, 0.01, 4, 0.01, tree=True), StepEvent(2, 4, 2, 1, 2, 0.001, 0.01, 6, 0.02))
    dialog.set_measurement(tree, "a tree answer")
    assert dialog.advisor.advice is None and not dialog.advisor.apply.isEnabled()
    assert "token trees" in dialog.advisor.label.text()


def test_method_list_comes_from_the_engine(qtbot, make_window):
    window = make_window(tiny_factory(), preload=True, settings=AppSettings(method="lookup", draft="tiny"))
    qtbot.waitUntil(lambda: window._loaded is not None, timeout=30_000)
    dialog = window.settings_dialog()
    qtbot.addWidget(dialog)
    offered = [dialog.method.itemData(i) for i in range(dialog.method.count())]
    assert offered == list(window._loaded.methods) and "tree" in offered  # not a hard-coded list
    assert AppSettings(method="medusa").method == "medusa"  # only the engine can say it is missing
    with pytest.raises(ValueError):
        AppSettings(method="")


def test_selftest_runs_on_the_worker_thread_and_reports_pass_then_fail(qtbot, make_window):
    window = make_window(tiny_factory())
    window.apply_settings(AppSettings(method="draft", draft="tiny"), persist=False)
    from speclens.engine.decoding.verify import verify_chain

    threads = set()

    def recording(*args, **kwargs):
        threads.add(threading.current_thread())
        return verify_chain(*args, **kwargs)

    with qtbot.waitSignal(window.selftest_finished, timeout=120_000) as blocker:
        assert window.run_selftest(trials=4096, verify=recording)
        assert not window.selftest_action.isEnabled()
        dialog = window.selftest_dialog
        assert dialog.isVisible() and dialog.progress.isVisible()
    report = blocker.args[0]
    assert report.passed, report.lines
    assert threads and threading.main_thread() not in threads
    lines = dialog.lines.toPlainText()
    assert "PASS" in dialog.verdict.text()
    verifier_checks = [line for line in lines.splitlines() if "exactness" in line]
    assert "chain exactness K=1" in lines and "chain exactness K=3" in lines
    assert all("4096 trials" in line for line in verifier_checks)
    for method in ("draft", "lookup", "tree"):
        assert f"PASS greedy equality {method} vs ar" in lines
    assert "block invariance" in lines  # tiny models on PyTorch's kernels: reported, not judged
    assert not dialog.progress.isVisible() and window.selftest_action.isEnabled()

    with qtbot.waitSignal(window.selftest_finished, timeout=120_000) as blocker:
        assert window.run_selftest(trials=4096, verify=residual_softmax)
    assert not blocker.args[0].passed
    assert "FAIL" in dialog.verdict.text() and "FAIL chain exactness" in dialog.lines.toPlainText()


def test_request_ids_belong_to_the_worker(qtbot):
    first, second = EngineWorker(tiny_factory()), EngineWorker(tiny_factory())
    settings = AppSettings()
    a = first.new_request(settings.model_settings(), (("user", "hi"),), settings.generation_config())
    b = first.new_request(settings.model_settings(), (("user", "hi"),), settings.generation_config())
    c = second.new_request(settings.model_settings(), (("user", "hi"),), settings.generation_config())
    assert (a.id, b.id, c.id) == (1, 2, 1)
    assert a.config.adaptive_k


def test_compare_tab_fits_1280_pixels_with_long_labels(qtbot, make_window):
    window = make_window(tiny_factory())
    window.tabs.setCurrentWidget(window.compare)
    long_title = "Speculative (draft, K≤16 adaptive, seed 2147483647) " * 3
    window.compare.right.title.setText(long_title)
    window.compare.right.speed.setText("1234.5 tok/s · 8192 tokens · τ 12.34 " * 3)
    window.status_model.setText("Qwen2.5-7B-Instruct (cuda, bfloat16) + draft Qwen2.5-0.5B-Instruct")
    assert window.minimumSizeHint().width() <= 1280
    window.resize(1280, 800)
    qtbot.waitUntil(lambda: window.width() == 1280, timeout=5_000)
    assert window.compare.right.title.toolTip() == long_title  # the full text stays reachable


def test_selftest_can_be_cancelled(qtbot, make_window):
    window = make_window(tiny_factory())
    with qtbot.waitSignal(window.selftest_finished, timeout=60_000) as blocker:
        assert window.run_selftest(trials=1_000_000)
        assert not window.run_selftest(trials=4096)  # one at a time
        window._selftest.cancel.set()  # what closing the window does
    report = blocker.args[0]
    assert not report.passed and "cancelled" in report.lines[0]
    assert window.selftest_action.isEnabled()
