"""Plots fed by StepEvents; settings persistence, snapshots and the dialog."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from speclens.app.settings import CATALOG, AppSettings, SettingsDialog, SettingsStore, method_label, needs_reload
from speclens.app.stats import diff_tokens, step_series
from speclens.engine.decoding.events import StepEvent
from speclens.engine.session import ModelSettings
from tests.app_fixtures import app_dirs, make_window, send_and_wait, tiny_factory  # noqa: F401 (fixtures)


def step(i: int, drafted: int, accepted: int, new_tokens: int, elapsed: float, k: int = 4) -> StepEvent:
    return StepEvent(i, k, drafted, accepted, accepted + 1, 0.001, 0.002, new_tokens, elapsed)


def test_step_series_statistics():
    events = [step(0, 4, 4, 5, 0.5), step(1, 4, 1, 7, 1.0), step(2, 2, 0, 8, 2.0), step(3, 0, 0, 9, 2.5)]
    s = step_series(events, window=2)
    assert s.acceptance[:3] == (1.0, 0.25, 0.0) and math.isnan(s.acceptance[3])
    assert s.rolling_acceptance[1] == pytest.approx(5 / 8)
    assert s.per_position == pytest.approx((2 / 3, 1 / 3, 1 / 2, 1 / 2))
    assert s.histogram == (1, 1, 0, 0, 1)  # the step with nothing drafted is not counted
    assert s.mean_accepted_length[-1] == pytest.approx((5 + 2 + 1 + 1) / 4)
    assert s.tokens_per_s[0] == pytest.approx(10.0)
    assert s.tokens_per_s[3] == pytest.approx((9 - 7) / (2.5 - 1.0))


def test_a_constant_step_rate_plots_as_a_flat_line_whatever_the_prefill():
    # 2 s of prefill, then a step every 10 ms emitting 3 tokens: 300 tok/s from the very first step
    prefill = 2.0
    events = [StepEvent(i + 1, 4, 4, 2, 3, 0.004, 0.006, 3 * (i + 1), prefill + 0.01 * (i + 1), prefill_s=prefill)
              for i in range(40)]
    rates = step_series(events).tokens_per_s
    assert rates == pytest.approx([300.0] * 40)
    # the curve before this fix: measured from the request's start, the first 16 steps ramped up
    ramped = step_series([replace(e, prefill_s=0.0) for e in events]).tokens_per_s
    assert ramped[0] < 2 and ramped[15] < 300 * 0.5


def test_diff_tokens_marks_changes():
    same = diff_tokens([1, 2, 3], [1, 2, 3])
    assert same.identical and not same.right_changed and same.first_difference is None
    diff = diff_tokens([1, 2, 3, 4], [1, 9, 3, 4])
    assert not diff.identical and diff.left_changed == {1} and diff.right_changed == {1}
    assert diff.first_difference == 1


def test_plots_receive_points_and_reshow_an_earlier_answer(qtbot, make_window):
    window = make_window(tiny_factory())
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=4, max_new_tokens=24))
    send_and_wait(qtbot, window, "first")
    first_steps = window.plots.steps
    assert len(first_steps) >= 24 / 5 and sum(s.emitted for s in first_steps) == 24
    x, y = window.plots._tau_curve.getData()
    assert len(x) == len(first_steps) and np.all(y >= 1.0)
    x, y = window.plots._acc_rolling.getData()
    assert len(x) == len(first_steps) and np.all((y >= 0) & (y <= 1))
    assert len(window.plots._speed_curve.getData()[0]) > 0
    assert "tok/s" in window.plots.summary.text()

    window.apply_settings(AppSettings(method="lookup", k=2, max_new_tokens=10))
    send_and_wait(qtbot, window, "second")
    assert window.plots.steps != first_steps
    window._show_answer_plots(1)  # the first assistant message
    assert window.plots.steps == first_steps


def test_settings_round_trip_and_bad_file(app_dirs):
    config, _ = app_dirs
    store = SettingsStore()
    assert store.path.parent == config
    assert store.load() == AppSettings()
    chosen = AppSettings(target="Qwen/Qwen2.5-1.5B-Instruct", method="draft", draft="Qwen/Qwen2.5-0.5B-Instruct",
                         k=7, temperature=0.7, top_k=40, top_p=0.9, seed=123, max_new_tokens=64,
                         device="cpu", dtype="float32", cpu_kernels="native", tree_budget=12,
                         system_prompt="Answer in French.\nBe brief.")
    store.save(chosen)
    assert SettingsStore().load() == chosen
    # a bad value keeps its own default; the rest of the file is kept, and the file as it was is backed up
    bad = ("k = 99\nmethod = 'ar'\ntop_p = 0\nseed = 1099511627776\nmax_new_tokens = 4.5\nadaptive_k = 1\n"
           "temperature = 1\nsystem_prompt = 3\ncpu_kernels = 'fast'\n")
    store.path.write_text(bad)
    assert store.load() == AppSettings(method="ar", temperature=1.0)
    assert [line.split(" =")[0] for line in store.problems[:-1]] == ["k", "top_p", "seed", "max_new_tokens",
                                                                     "cpu_kernels", "adaptive_k", "system_prompt"]
    assert store.path.with_suffix(".toml.bak").read_text() == bad and ".bak" in store.problems[-1]
    store.path.write_text("not [ toml")
    assert store.load() == AppSettings() and "not valid TOML" in store.problems[0]
    store.save(chosen)
    assert store.load() == chosen and store.problems == ()
    with pytest.raises(ValueError):
        AppSettings(k=17)
    with pytest.raises(ValueError, match="tree nodes"):
        AppSettings(tree_budget=129)
    with pytest.raises(ValueError, match="system prompt"):
        AppSettings(system_prompt="x" * 20_001)
    assert AppSettings(tree_budget=128).tree_budget == 128


def test_generation_config_and_reload_rules():
    s = AppSettings(method="draft", draft="d", k=5, temperature=0.5, seed=-1)
    config = s.generation_config()
    assert (config.method, config.k, config.sampling.temperature, config.seed) == ("draft", 5, 0.5, None)
    assert s.generation_config("ar").method == "ar"
    loaded = ModelSettings(target="t", draft="d")
    assert not needs_reload(loaded, ModelSettings(target="t", draft=None))
    assert needs_reload(loaded, ModelSettings(target="t", draft="other"))
    assert needs_reload(loaded, ModelSettings(target="u"))
    assert needs_reload(None, ModelSettings())
    assert AppSettings().model_settings().tree_budget is None  # 0 in the dialog: by device
    assert AppSettings(tree_budget=8).model_settings().tree_budget == 8
    assert needs_reload(loaded, ModelSettings(target="t", draft="d", tree_budget=8))  # drafters are built at load
    assert AppSettings(cpu_kernels="integer").model_settings().cpu_kernels == "integer"
    assert needs_reload(loaded, ModelSettings(target="t", draft="d", cpu_kernels="native"))  # kernels swap at load
    turns = (("user", "hi"),)
    assert AppSettings().conversation(turns) == turns  # no system prompt: the template's default
    assert AppSettings(system_prompt="  Be brief. ").conversation(turns) == (("system", "Be brief."), ("user", "hi"))


def test_settings_apply_to_the_next_message_only(qtbot, make_window, app_dirs):
    window = make_window(tiny_factory(step_delay_s=0.02))
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=4, max_new_tokens=30))
    with qtbot.waitSignal(window.answer_finished, timeout=60_000) as first:
        window.send_message("one")
        qtbot.waitUntil(lambda: len(window.chat.live_tokens) > 0, timeout=30_000)
        window.apply_settings(AppSettings(method="draft", draft="tiny", k=2, max_new_tokens=30))
    first_steps = window._answer_steps[1][0]
    assert max(s.k for s in first_steps) == 4  # k can shrink near max_new_tokens
    assert "K=4" in first.args[0].meta
    send_and_wait(qtbot, window, "two")
    assert max(s.k for s in window.plots.steps) == 2
    assert SettingsStore().load().k == 2  # persisted too


def test_settings_dialog_round_trip_and_catalog(qtbot):
    chosen = AppSettings(method="lookup", k=6, temperature=0.3, seed=5, max_new_tokens=100, tree_budget=16,
                         system_prompt="You are terse.")
    dialog = SettingsDialog(chosen)
    qtbot.addWidget(dialog)
    assert dialog.settings() == chosen
    qwen = next(i for i, e in enumerate(CATALOG) if "Qwen2.5-7B" in e.target)
    dialog.pair.setCurrentIndex(qwen)
    dialog._apply_pair(qwen)
    edited = dialog.settings()
    assert (edited.target, edited.draft, edited.method) == (
        "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "draft")
    dialog.show_report(False, ("vocabularies differ",))
    assert "vocabularies differ" in dialog.report.toPlainText()
    dialog.show_report(None, ("SmolLM2-135M-Instruct (cpu)",))  # one model: nothing claimed about a pair
    assert "compatible" not in dialog.report.toPlainText() and "one model" in dialog.report.toPlainText()


def test_the_status_bar_names_the_method_briefly(make_window):
    window = make_window(tiny_factory())
    assert window.status_method.text() == "Method: auto"
    assert window.status_method.toolTip() == method_label("auto")


def test_summary_names_the_proposers_only_when_several_drafted():
    from dataclasses import replace

    from speclens.app.plots import summary_text
    from speclens.engine.decoding.events import Summary

    summary = Summary("eagle_lookup", 20, 8, 14, 12, 2.5, (0.9, 0.8), (1, 2, 5), 10.0, 2.0, 0.1, "eos", "text",
                      accepted_by=(("eagle", 8), ("lookup", 3), ("rest", 1)))
    assert "accepted 12 (86%: eagle 8, lookup 3, rest 1)" in summary_text(summary)
    alone = replace(summary, method="lookup", accepted_by=(("lookup", 12),))
    assert "accepted 12 (86%) · stop" in summary_text(alone)


def test_k_axis_levels_its_largest_k_with_rate_one(qtbot):
    from speclens.app.plots import RATE_RANGE, StepPlots

    plots = StepPlots()
    qtbot.addWidget(plots)
    plots.set_steps([step(0, 3, 3, 4, 0.1, k=3), step(1, 6, 2, 7, 0.2, k=6), step(2, 2, 0, 8, 0.3, k=2)])
    low, high = plots._k_view.viewRange()[1]
    # the K view maps K linearly onto the rate axis: K = 0 at rate 0 and the largest K (6) at rate 1
    rate_low, rate_high = RATE_RANGE
    assert (low / 6, high / 6) == pytest.approx((rate_low, rate_high))
    ticks = plots.acceptance.getPlotItem().getAxis("right")._tickLevels[0]
    assert [label for _, label in ticks] == ["1", "2", "3", "4", "5", "6"]
    assert list(plots._k_curve.getData()[1]) == [3, 6, 2]


def test_position_and_histogram_axes_show_drafts_past_k(qtbot):
    from speclens.app.plots import StepPlots

    plots = StepPlots()
    qtbot.addWidget(plots)
    plots.set_steps([step(0, 2, 2, 3, 0.1), step(1, 3, 1, 5, 0.2)])
    assert plots.positions.getPlotItem().vb.viewRange()[0] == pytest.approx([-0.6, 3.6])  # K = 4 bars
    assert plots.histogram.getPlotItem().vb.viewRange()[0] == pytest.approx([-0.6, 4.6])
    # a lookup chain of 8 grafted into a K = 4 tree, all of it accepted: every bar stays in view
    plots.set_steps([step(0, 8, 8, 9, 0.1), step(1, 3, 1, 11, 0.2)])
    assert plots.positions.getPlotItem().vb.viewRange()[0] == pytest.approx([-0.6, 7.6])
    assert plots.histogram.getPlotItem().vb.viewRange()[0] == pytest.approx([-0.6, 8.6])


def test_the_window_says_which_stored_settings_it_could_not_use(make_window, app_dirs):
    config, _ = app_dirs
    config.mkdir(parents=True)
    (config / "settings.toml").write_text("k = 40\nmethod = 'lookup'\n")
    window = make_window(tiny_factory())
    assert window.settings == AppSettings(method="lookup")
    assert window.error_banner.isVisible()
    assert "k = 40" in window.error_banner.text() and "settings.toml.bak" in window.error_banner.text()
