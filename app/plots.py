"""Live plots of one answer's verification steps (pyqtgraph), redrawn on a timer, not per event."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QGridLayout, QLabel, QVBoxLayout, QWidget

from engine.events import StepEvent, Summary

from app.stats import ROLLING_STEPS, step_series

REDRAW_MS = 100
ACCENT = "#2563eb"
ACCEPT = "#3f9c4f"
MUTED = "#9aa3ae"


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
    widget.setMinimumSize(220, 150)
    return widget


class StepPlots(QWidget):
    """Five panels over the StepEvents of one answer; `set_steps` re-shows a stored answer."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._steps: list[StepEvent] = []
        self._dirty = False

        self.acceptance = _plot("Acceptance rate per step", "step", "accepted / drafted")
        self.acceptance.setYRange(0, 1.05)
        self.acceptance.addLegend(offset=(-5, 5), labelTextSize="8pt")
        self._acc_points = self.acceptance.plot(
            pen=None, symbol="o", symbolSize=4, symbolBrush=MUTED, symbolPen=None, name="step"
        )
        self._acc_rolling = self.acceptance.plot(
            pen=pg.mkPen(ACCEPT, width=2), name=f"rolling ({ROLLING_STEPS} steps)"
        )

        self.speed = _plot("Decoding speed", "step", "tokens/s", None)
        self._speed_curve = self.speed.plot(pen=pg.mkPen(ACCENT, width=2))

        self.tau = _plot("Mean accepted length τ", "step", "tokens per target pass")
        self._tau_curve = self.tau.plot(pen=pg.mkPen("#7c3aed", width=2))

        self.positions = _plot("Acceptance by draft position", "draft position", "P(accepted)")
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
        rate = np.asarray(series.tokens_per_s, dtype=float)
        keep = ~np.isnan(rate)
        self._speed_curve.setData(x[keep], rate[keep])
        self._tau_curve.setData(x, np.asarray(series.mean_accepted_length, dtype=float))
        per_position = np.nan_to_num(np.asarray(series.per_position, dtype=float))
        self._position_bars.setOpts(x=np.arange(len(per_position)), height=per_position)
        histogram = np.asarray(series.histogram, dtype=float)
        self._histogram_bars.setOpts(x=np.arange(len(histogram)), height=histogram)
        k = max((e.k for e in self._steps), default=4)
        self.positions.setXRange(-0.6, k - 0.4, padding=0)
        self.histogram.setXRange(-0.6, k + 0.6, padding=0)


def summary_text(s: Summary) -> str:
    return (
        f"<b>{s.method}</b>: {s.new_tokens} tokens in {s.elapsed_s:.2f} s "
        f"(prefill {s.prefill_s:.2f} s)<br>"
        f"<b>{s.tokens_per_s:.1f}</b> tok/s · τ = <b>{s.mean_accepted_length:.2f}</b> · "
        f"{s.steps} target passes<br>"
        f"drafted {s.drafted}, accepted {s.accepted} "
        f"({100 * s.acceptance_rate:.0f}%) · stop: {s.stop_reason}"
    )
