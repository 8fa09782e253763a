"""Live plots of one answer's verification steps (pyqtgraph), redrawn on a timer, not per event."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QPushButton, QVBoxLayout, QWidget

from speclens.app.stats import ROLLING_STEPS, advise, speedup_at, step_series
from speclens.engine.decoding.advisor import Advice
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent, Summary

REDRAW_MS = 250  # plots redraw at most 4 times a second: each redraw takes CPU from decoding on a 2-core machine
ACCENT = "#2563eb"
ACCEPT = "#3f9c4f"
MUTED = "#9aa3ae"
DRAFT_K = "#d97706"
FEW_STEPS = 16  # below this many drafting steps the advisor's inputs are noisy
RATE_RANGE = (-0.05, 1.05)  # the acceptance plot's y range, with room for the dots at 0 and 1


def _plot(title: str, x_label: str, y_label: str, y_units: str | None = None) -> pg.PlotWidget:
    widget = pg.PlotWidget(background="w")
    widget.setTitle(title, color="#374151", size="9pt")
    item = widget.getPlotItem()
    item.setLabel("bottom", x_label)
    item.setLabel("left", y_label, units=y_units)
    item.showGrid(x=True, y=True, alpha=0.25)
    item.setMenuEnabled(False)
    for axis in ("bottom", "left"):
        item.getAxis(axis).enableAutoSIPrefix(False)
        item.getAxis(axis).setTextPen("#4b5563")
        item.getAxis(axis).setPen("#9ca3af")
    widget.setMinimumSize(240, 150)  # the acceptance plot's two axes and titles fit
    return widget


class StepPlots(QWidget):
    """Five panels over the StepEvents of one answer; `set_steps` re-shows a stored answer."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._steps: list[StepEvent] = []
        self._dirty = False

        # The key is a second title line, not a legend, so it never hides a step at any widget size.
        key = (f"<span style='font-size:7pt'><span style='color:{MUTED}'>● step</span> &nbsp;"
               f"<span style='color:{ACCEPT}'>━ last {ROLLING_STEPS}</span> &nbsp;"
               f"<span style='color:{DRAFT_K}'>━ K (right)</span></span>")
        self.acceptance = _plot(f"Acceptance rate per step<br>{key}", "step", "accepted / drafted")
        self.acceptance.setToolTip(f"Grey dots: accepted / drafted tokens of each step. Green: the mean over the last "
                                   f"{ROLLING_STEPS} steps. Orange: the draft length K asked for (right axis).")
        self.acceptance.setYRange(*RATE_RANGE, padding=0)
        self.acceptance.getPlotItem().getAxis("left").setTicks(
            [[(v, f"{v:g}") for v in (0, 0.25, 0.5, 0.75, 1)], [(v, "") for v in (0.125, 0.375, 0.625, 0.875)]])
        self._acc_points = self.acceptance.plot(pen=None, symbol="o", symbolSize=4, symbolBrush=MUTED, symbolPen=None)
        self._acc_rolling = self.acceptance.plot(pen=pg.mkPen(ACCEPT, width=2))
        # K per step on a right-hand axis of the same plot: with adaptive K it moves with acceptance
        item = self.acceptance.getPlotItem()
        self._k_view = pg.ViewBox(enableMenu=False)
        self._k_view.setMouseEnabled(x=False, y=False)
        item.showAxis("right")
        item.scene().addItem(self._k_view)
        self._k_view.setZValue(-1)  # under the rate curves
        right = item.getAxis("right")
        right.linkToView(self._k_view)
        right.setLabel("K", color=DRAFT_K)
        right.setTextPen(DRAFT_K)
        right.setPen("#9ca3af")
        right.enableAutoSIPrefix(False)
        self._k_view.setXLink(item.vb)
        item.vb.sigResized.connect(self._sync_k_view)
        self._k_curve = pg.PlotDataItem(pen=pg.mkPen(DRAFT_K, width=1.5), stepMode="right")
        self._k_view.addItem(self._k_curve)

        self.speed = _plot("Decoding speed", "step", "tokens/s", None)
        self._speed_curve = self.speed.plot(pen=pg.mkPen(ACCENT, width=2))

        self.tau = _plot("Mean accepted length τ", "step", "tokens per target pass")
        self._tau_curve = self.tau.plot(pen=pg.mkPen("#7c3aed", width=2))

        self.positions = _plot("Acceptance by position", "draft position", "P(accepted)")
        self.positions.setYRange(0, 1.05)
        self._position_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=ACCEPT, pen=None)
        self.positions.addItem(self._position_bars)

        self.histogram = _plot("Accepted length per step", "drafts accepted", "steps")
        self._histogram_bars = pg.BarGraphItem(x=[], height=[], width=0.7, brush=ACCENT, pen=None)
        self.histogram.addItem(self._histogram_bars)

        self.summary = QLabel("No answer yet.")
        self.summary.setWordWrap(True)
        self.summary.setStyleSheet("color: #374151; padding: 6px;")

        grid = QGridLayout()
        grid.setSpacing(6)
        grid.addWidget(self.acceptance, 0, 0)
        grid.addWidget(self.speed, 0, 1)
        grid.addWidget(self.tau, 1, 0)
        grid.addWidget(self.positions, 1, 1)
        grid.addWidget(self.histogram, 2, 0)
        grid.addWidget(self.summary, 2, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addLayout(grid)

        self._timer = QTimer(self, interval=REDRAW_MS)
        self._timer.timeout.connect(self._redraw_if_dirty)
        self._timer.start()

    @property
    def steps(self) -> tuple[StepEvent, ...]:
        return tuple(self._steps)

    def add_steps(self, events: Iterable[StepEvent]) -> None:
        self._steps.extend(events)
        self._dirty = True

    def set_steps(self, events: Iterable[StepEvent], caption: str = "") -> None:
        self._steps = list(events)
        self.summary.setText(caption)
        self.redraw()

    def clear(self) -> None:
        self.set_steps(())
        self.summary.setText("Generating…")

    def set_summary(self, summary: Summary) -> None:
        self.summary.setText(summary_text(summary))
        self.redraw()

    def set_caption(self, caption: str) -> None:
        self.summary.setText(caption)

    def _sync_k_view(self) -> None:
        self._k_view.setGeometry(self.acceptance.getPlotItem().vb.sceneBoundingRect())

    def _redraw_if_dirty(self) -> None:
        if self._dirty:
            self.redraw()

    def redraw(self) -> None:
        self._dirty = False
        series = step_series(self._steps)
        x = np.asarray(series.steps, dtype=float)
        acceptance = np.asarray(series.acceptance, dtype=float)
        keep = ~np.isnan(acceptance)
        self._acc_points.setData(x[keep], acceptance[keep])
        rolling = np.asarray(series.rolling_acceptance, dtype=float)
        keep = ~np.isnan(rolling)
        self._acc_rolling.setData(x[keep], rolling[keep])
        ks = np.asarray([e.k for e in self._steps], dtype=float)
        self._k_curve.setData(x, ks)
        # K = k_max level with rate 1.0 and K = 0 with rate 0
        k_max = max(int(ks.max(initial=0.0)), 1)
        self._k_view.setYRange(RATE_RANGE[0] * k_max, RATE_RANGE[1] * k_max, padding=0)
        self.acceptance.getPlotItem().getAxis("right").setTicks([[(k, str(k)) for k in range(1, k_max + 1)]])
        rate = np.asarray(series.tokens_per_s, dtype=float)
        keep = ~np.isnan(rate)
        self._speed_curve.setData(x[keep], rate[keep])
        if keep.any():  # from 0, so that a steady rate reads as the flat line it is (autorange magnified noise)
            self.speed.setYRange(0, float(rate[keep].max()) * 1.1, padding=0)
        self._tau_curve.setData(x, np.asarray(series.mean_accepted_length, dtype=float))
        per_position = np.nan_to_num(np.asarray(series.per_position, dtype=float))
        self._position_bars.setOpts(x=np.arange(len(per_position)), height=per_position)
        histogram = np.asarray(series.histogram, dtype=float)
        self._histogram_bars.setOpts(x=np.arange(len(histogram)), height=histogram)
        # at least K bars; more where a grafted lookup chain drafted past K (eagle_lookup)
        k = max((e.k for e in self._steps), default=4)
        self.positions.setXRange(-0.6, max(k, len(per_position)) - 0.4, padding=0)
        self.histogram.setXRange(-0.6, max(k, len(histogram) - 1) + 0.6, padding=0)


def summary_text(s: Summary) -> str:
    # several proposers in one tree (eagle_lookup): whose drafts the target accepted
    by = ", ".join(f"{name} {n}" for name, n in s.accepted_by) if len(s.accepted_by) > 1 else ""
    return (
        f"<b>{s.method}</b>: {s.new_tokens} tokens in {s.elapsed_s:.2f} s "
        f"(prefill {s.prefill_s:.2f} s)<br>"
        f"<b>{s.tokens_per_s:.1f}</b> tok/s · τ = <b>{s.mean_accepted_length:.2f}</b> · "
        f"{s.steps} target passes<br>"
        f"drafted {s.drafted}, accepted {s.accepted} "
        f"({100 * s.acceptance_rate:.0f}%{': ' + by if by else ''}) · stop: {s.stop_reason}"
    )


class AdvisorPanel(QWidget):
    """Predicted speedup over K = 1..k_max from one answer's steps (engine.advisor), with the best
    K marked; `apply_requested` carries the recommended K."""

    apply_requested = Signal(int)

    def __init__(self, k_max: int, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.k_max = k_max
        self.advice: Advice | None = None
        self.plot = _plot("Predicted speedup by draft length", "draft length K", "× plain decoding")
        self.plot.setMinimumSize(320, 220)
        self.plot.setXRange(0.5, k_max + 0.5, padding=0)
        self.plot.addItem(pg.InfiniteLine(pos=1.0, angle=0, pen=pg.mkPen(MUTED, style=Qt.PenStyle.DashLine)))
        self._curve = self.plot.plot(pen=pg.mkPen(ACCENT, width=2), symbol="o", symbolSize=5,
                                     symbolBrush=ACCENT, symbolPen=None)
        self._best = self.plot.plot(pen=None, symbol="star", symbolSize=18, symbolBrush=ACCEPT, symbolPen="w")
        self._best_line = pg.InfiniteLine(angle=90, pen=pg.mkPen(ACCEPT, width=1, style=Qt.PenStyle.DashLine))
        self._best_line.hide()
        self.plot.addItem(self._best_line)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.apply = QPushButton("Use recommended K")
        self.apply.clicked.connect(self._apply_clicked)
        row = QHBoxLayout()
        row.addWidget(self.label, 1)
        row.addWidget(self.apply, 0, Qt.AlignmentFlag.AlignTop)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.plot, 1)
        layout.addLayout(row)
        self.set_measurement(())

    def set_measurement(self, steps: Sequence[StepEvent], source: str = "", current_k: int | None = None,
                        verify_shape: StepCost | None = None) -> None:
        self.advice = advise(steps, self.k_max, verify_shape) if steps else None
        advice = self.advice
        if advice is None:
            self._curve.setData([], [])
            self._best.setData([], [])
            self._best_line.hide()
            self.apply.setEnabled(False)
            self.apply.setText("Use recommended K")
            if not steps:
                text = ("No measurement yet: send a message with a drafting method (or run a comparison), "
                        "then reopen the settings to see the predicted speedup for each K.")
            elif any(s.tree for s in steps):
                text = ("The last answer verified token trees (a tree, EAGLE or Medusa method), whose target "
                        "passes check more tokens than K; the advisor models chains of K drafts, so it "
                        "predicts nothing here. Send a message with a chain method (draft, lookup, "
                        "eagle_chain) to see the curve.")
            else:
                text = ("The last answer drafted nothing (plain decoding), so there is no acceptance to "
                        "measure. Send a message with a drafting method first.")
            self.label.setText(text)
            return
        best = advice.speedup[advice.best_k - advice.ks[0]]
        self._curve.setData(list(advice.ks), list(advice.speedup))
        self._best.setData([advice.best_k], [best])
        self._best_line.setPos(advice.best_k)
        self._best_line.show()
        self.plot.setYRange(0, max(max(advice.speedup), 1.0) * 1.15, padding=0)
        self.apply.setEnabled(True)
        self.apply.setText(f"Use K = {advice.best_k}")
        text = (
            f"Recommended <b>K = {advice.best_k}</b>: predicted <b>{best:.2f}×</b> plain decoding, "
            f"{advice.expected_tokens[advice.best_k - advice.ks[0]]:.2f} tokens per target pass."
        )
        if best < 1.0:
            text += (
                " <span style='color:#b00020'>Every K is predicted slower than plain decoding: too few "
                "drafts are accepted to pay for drafting.</span>"
            )
        if current_k is not None:
            text += f" Current K = {current_k}: {speedup_at(advice, current_k):.2f}×."
        drafted = sum(1 for s in steps if s.drafted)
        rough = " — few steps, so a rough estimate" if drafted < FEW_STEPS else ""
        text += (
            f"<br><span style='color:#6b7280'>Measured on {source or 'the last answer'}: "
            f"{drafted} drafting steps{rough}.</span>"
        )
        self.label.setText(text)

    def _apply_clicked(self) -> None:
        if self.advice is not None:
            self.apply_requested.emit(self.advice.best_k)
