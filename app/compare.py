"""Side-by-side mode: the same prompt and seed decoded plainly (left) and speculatively (right), as a race.

The runs go to the one worker, which serialises them, so they never compete for the device: `Runs`
pairs (Settings, default 3), interleaved plain / speculative, and the figures are the medians. While
they are timed the tab draws a status line at most four times a second and no text, so drawing does
not share the cores with decoding. Then the median run of each side is replayed on one shared clock
at the pace it was measured: each step's tokens appear at the time that step ended (prefill
included, so the first token comes at its measured time to first token).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QKeySequence, QPainter, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)
from superqt.utils import qthrottled

from speclens.app.chat_view import token_format
from speclens.app.settings import AppSettings
from speclens.app.stats import TokenDiff, advise, diff_tokens, speedup_at
from speclens.app.worker import EngineWorker, LoadInfo
from speclens.engine.decoding.advisor import Advice
from speclens.engine.decoding.drafter import StepCost
from speclens.engine.decoding.events import StepEvent, Summary, TokenEvent


@dataclass(frozen=True)
class CompareResult:
    baseline: Summary | None
    speculative: Summary | None
    speedup: float | None  # speculative tok/s over plain tok/s
    tau: float | None
    diff: TokenDiff | None  # only at temperature 0, where outputs must match
    error: str = ""
    advice: Advice | None = None  # the advisor's prediction from the speculative run's steps
    predicted_k: int | None = None  # the K the prediction is read at (mean K when adaptive)
    predicted_speedup: float | None = None
    speculative_steps: tuple[StepEvent, ...] = field(default=(), repr=False)
    stopped: bool = False  # the user stopped it before both runs finished: nothing to compare
    runs: int = 1  # pairs of runs the figures are medians of
    speedups: tuple[float, ...] = ()  # each pair's speculative over plain tok/s, in run order


REPLAY_TICK_MS = 33  # the race's frames
STATUS_MS = 250  # while runs are timed, the tab redraws at most this often
MAX_REPLAY_S = 20.0  # a longer race is replayed faster, by the factor it says


@dataclass
class _Run:
    """One timed run: what the worker reported for it."""

    side: str  # "plain" or "speculative"
    pair: int  # 1-based
    tokens: list[TokenEvent] = field(default_factory=list)
    steps: list[StepEvent] = field(default_factory=list)
    summary: Summary | None = None


class ElidedLabel(QLabel):
    """One line of plain text that elides instead of widening its window (full text as tooltip)."""

    def __init__(self, text: str = "", bold: bool = False, parent: QWidget | None = None) -> None:
        super().__init__(text, parent)
        if bold:
            font = self.font()
            font.setBold(True)
            self.setFont(font)
        self.setTextFormat(Qt.TextFormat.PlainText)

    def setText(self, text: str) -> None:
        super().setText(text)
        self.setToolTip(text)

    def minimumSizeHint(self) -> QSize:
        return QSize(min(60, super().sizeHint().width()), super().minimumSizeHint().height())

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        rect = self.contentsRect()
        elided = self.fontMetrics().elidedText(self.text(), Qt.TextElideMode.ElideRight, rect.width())
        painter.drawText(rect, int(self.alignment() | Qt.AlignmentFlag.AlignVCenter), elided)


class ComparePane(QWidget):
    """One side: a title, its live speed, and the streamed tokens (plain text, so a diff can mark
    exact tokens)."""

    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = ElidedLabel(title, bold=True)
        self.speed = ElidedLabel("—")
        self.speed.setStyleSheet("color: #4b5563;")
        self.view = QTextBrowser()
        self.view.document().setDocumentMargin(12)
        self.tokens: list[TokenEvent] = []
        self.first_token_s: float | None = None
        self._queue: list[tuple[float, TokenEvent]] = []  # (time it was made, token) of the run replayed
        self._summary: Summary | None = None
        self.colours = True
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.title)
        layout.addWidget(self.speed)
        layout.addWidget(self.view, 1)

    def reset(self) -> None:
        self.tokens = []
        self.first_token_s: float | None = None  # prefill and the first step: apart from the decoding rate
        self.view.clear()
        self.speed.setText("waiting…")

    def append(self, tokens: Sequence[TokenEvent]) -> None:
        self.tokens.extend(tokens)
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        for token in tokens:
            cursor.insertText(token.text, token_format(token, self.colours))
        self.view.verticalScrollBar().setValue(self.view.verticalScrollBar().maximum())

    def show_step(self, step: StepEvent) -> None:
        if self.first_token_s is None:
            self.first_token_s = step.elapsed_s
        if step.decode_s > 0:  # decoding's own rate, from its first step (the prefill is not decoding)
            self.speed.setText(f"{step.new_tokens / step.decode_s:.1f} tok/s · {step.new_tokens} tokens · "
                               f"first token {self.first_token_s:.2f} s")

    def show_summary(self, summary: Summary) -> None:
        first = f" · first token {self.first_token_s:.2f} s" if self.first_token_s is not None else ""
        self.speed.setText(
            f"{summary.tokens_per_s:.1f} tok/s · {summary.new_tokens} tokens · τ {summary.mean_accepted_length:.2f}"
            f"{first}"
        )

    def load_replay(self, tokens: Sequence[TokenEvent], steps: Sequence[StepEvent], summary: Summary) -> None:
        """Hold a finished run to replay: its tokens appear when the step that made them ended."""
        self.view.clear()
        self.tokens = []
        ends = {step.step: step.elapsed_s for step in steps}
        self._queue = [(ends.get(token.step, summary.elapsed_s), token) for token in tokens]
        self._summary = summary
        self.first_token_s = steps[0].elapsed_s if steps else None
        self.speed.setText("0.00 s · 0 tokens")

    def show_until(self, t: float) -> bool:
        """Append the held tokens made by time t (seconds since the run's request); True once all are shown."""
        shown = len(self.tokens)
        while shown < len(self._queue) and self._queue[shown][0] <= t:
            shown += 1
        if shown > len(self.tokens):
            self.append([token for _, token in self._queue[len(self.tokens) : shown]])
        done = shown == len(self._queue) and t >= self._summary.elapsed_s
        if done:
            self.show_summary(self._summary)
            self.speed.setText(f"✓ {self._summary.elapsed_s:.2f} s · " + self.speed.text())
        else:
            self.speed.setText(f"{t:.2f} s · {shown} tokens")
        return done

    def mark(self, changed: frozenset[int]) -> None:
        """Underline the tokens that differ from the other side."""
        cursor = QTextCursor(self.view.document())
        position = 0
        mark = QTextCharFormat()
        mark.setUnderlineStyle(QTextCharFormat.UnderlineStyle.WaveUnderline)
        mark.setUnderlineColor(QColor("#d11a2a"))
        mark.setFontWeight(700)
        for index, token in enumerate(self.tokens):
            if index in changed and token.text:
                cursor.setPosition(position)
                cursor.setPosition(position + len(token.text), QTextCursor.MoveMode.KeepAnchor)
                cursor.mergeCharFormat(mark)
            position += len(token.text)


class ComparePanel(QWidget):
    finished = Signal(object)  # CompareResult
    started = Signal(str)  # a caption for the run that begins

    def __init__(self, worker: EngineWorker, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._worker = worker
        self._settings = AppSettings()
        self._runs: dict[int, _Run] = {}  # request id -> its record, for this comparison
        self._pending: set[int] = set()
        self._order: list[int] = []  # request ids in the order they run
        self._errors: list[str] = []
        self._verify_shape: StepCost | None = None  # the loaded target's, for the advisor
        worker.loaded.connect(self._on_loaded)
        self._greedy = True
        self._cancels: tuple = ()
        self._predicted_k: int | None = None
        self._spec_label = ""  # "K≤4 adaptive, seed 7": the right pane's title after its method
        self._live: _Run | None = None  # the run being timed, for the status line
        self._replay_start = 0.0
        self._replay = QTimer(self, interval=REPLAY_TICK_MS)
        self._replay.timeout.connect(self._tick)
        self._diff: TokenDiff | None = None
        self._chosen: tuple[_Run, _Run] | None = None  # the median run of each side, raced
        self._status = qthrottled(self._show_status, timeout=STATUS_MS, leading=True, parent=self)

        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText("One prompt, run plainly and speculatively with the same seed…")
        self.prompt.returnPressed.connect(self._run_clicked)
        self.run_button = QPushButton("Compare")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(self._run_clicked)
        self.replay_button = QPushButton("Replay")
        self.replay_button.setToolTip("Race the two answers again at the pace they were measured")
        self.replay_button.setEnabled(False)
        self.replay_button.clicked.connect(self.start_replay)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.setShortcut(QKeySequence(Qt.Key.Key_Escape))  # only while enabled and on show
        self.stop_button.setToolTip("Stop generating (Esc)")
        self.stop_button.clicked.connect(self.stop)
        self.left = ComparePane("Plain autoregressive")
        self.right = ComparePane("Speculative")
        self.result = QLabel("Run a prompt to compare plain and speculative decoding.")
        self.result.setWordWrap(True)
        self.result.setTextFormat(Qt.TextFormat.RichText)
        self.result.setStyleSheet(
            "QLabel { background: #f6f7f9; border: 1px solid #e3e6ea; border-radius: 6px; padding: 8px; }"
        )

        top = QHBoxLayout()
        top.addWidget(self.prompt, 1)
        top.addWidget(self.run_button)
        top.addWidget(self.replay_button)
        top.addWidget(self.stop_button)
        panes = QHBoxLayout()
        panes.setSpacing(10)
        panes.addWidget(self.left, 1)
        panes.addWidget(self.right, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(10, 10, 10, 10)
        layout.addLayout(top)
        layout.addLayout(panes, 1)
        layout.addWidget(self.result)

        worker.tokens.connect(self._on_tokens)
        worker.step.connect(self._on_step)
        worker.summary.connect(self._on_summary)
        worker.error.connect(self._on_error)
        worker.finished.connect(self._on_finished)

    @property
    def busy(self) -> bool:
        return bool(self._pending)

    @property
    def replaying(self) -> bool:
        return self._replay.isActive()

    @property
    def race_clock(self) -> float:
        """Seconds of measured time the race has replayed so far."""
        return (time.monotonic() - self._replay_start) * self.race_scale if self.replaying else self.race_length

    @property
    def race_scale(self) -> float:
        """How much faster than measured the race is replayed: 1, or more for a race past MAX_REPLAY_S."""
        return max(1.0, self.race_length / MAX_REPLAY_S)

    @property
    def race_length(self) -> float:
        """Measured seconds of the slower side (0 before a race)."""
        if self._chosen is None:
            return 0.0
        return max(run.summary.elapsed_s for run in self._chosen)

    def _on_loaded(self, info: LoadInfo) -> None:
        self._verify_shape = info.verify_shape

    def set_settings(self, settings: AppSettings) -> None:
        self._settings = settings

    def run(self, prompt: str) -> None:
        if self.busy or not prompt.strip():
            return
        self._replay.stop()
        snapshot = self._settings
        seed = snapshot.seed if snapshot.seed >= 0 else random.randrange(2**31)
        method = snapshot.method if snapshot.method != "ar" else "lookup"
        messages = snapshot.conversation((("user", prompt.strip()),))
        seeded = replace(snapshot, seed=seed)
        model = seeded.model_settings()
        requests = []
        for pair in range(1, snapshot.compare_runs + 1):  # interleaved: a slow spell hits both sides alike
            for side, config in (("plain", seeded.generation_config("ar")), ("speculative", seeded.generation_config(method))):
                request = self._worker.new_request(model, messages, config, tag="compare")
                requests.append(request)
                self._runs[request.id] = _Run(side, pair)
        self._greedy = snapshot.temperature == 0.0
        self._predicted_k = None if snapshot.adaptive_k else snapshot.k
        self._errors.clear()
        self._order = [r.id for r in requests]
        self._pending = set(self._order)
        self._runs = {rid: run for rid, run in self._runs.items() if rid in self._pending}
        self._cancels = tuple(r.cancel for r in requests)
        self._live = None
        self._diff = None
        self.left.reset()
        self.right.reset()
        k = f"K≤{snapshot.k} adaptive" if snapshot.adaptive_k else f"K={snapshot.k}"
        self._spec_label = f"{k}, seed {seed}"
        self.right.title.setText(f"Speculative ({method}, {self._spec_label})")
        self.left.title.setText(f"Plain autoregressive (seed {seed})")
        runs = snapshot.compare_runs
        self.result.setText(f"Timing {runs} run{'s' if runs != 1 else ''} of each, interleaved plain / speculative; "
                            "the race is replayed when they are done…")
        self.started.emit(f"Comparing: plain and {method} ({k}), {runs} run{'s' if runs != 1 else ''} each…")
        self.run_button.setEnabled(False)
        self.replay_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        for request in requests:
            self._worker.request_generate.emit(request)

    def stop(self) -> None:
        for cancel in self._cancels:
            cancel.set()
        if self._replay.isActive():
            self.finish_replay()

    def _run_clicked(self) -> None:
        self.run(self.prompt.text())

    def _pane(self, run: _Run) -> ComparePane:
        return self.left if run.side == "plain" else self.right

    def _on_tokens(self, rid: int, tokens: tuple[TokenEvent, ...]) -> None:
        run = self._runs.get(rid) if rid in self._pending else None
        if run is not None:
            run.tokens.extend(tokens)
            self._pane(run).tokens = run.tokens  # the data, live; the text waits for the race
            self._live = run
            self._status()

    def _on_step(self, rid: int, step: StepEvent) -> None:
        run = self._runs.get(rid) if rid in self._pending else None
        if run is not None:
            run.steps.append(step)
            self._live = run
            self._status()

    def _on_summary(self, rid: int, summary: Summary) -> None:
        run = self._runs.get(rid) if rid in self._pending else None
        if run is not None:
            run.summary = summary
            if run.side == "speculative" and summary.method:
                # "auto" resolves to the loaded models' best: name the method that ran
                self.right.title.setText(f"Speculative ({summary.method}, {self._spec_label})")

    def _show_status(self) -> None:
        run = self._live
        if run is None or not self._pending:
            return
        pairs = max(r.pair for r in self._runs.values())
        rate = ""
        if run.steps and run.steps[-1].decode_s > 0:
            rate = f", {run.steps[-1].new_tokens / run.steps[-1].decode_s:.0f} tok/s"
        self._pane(run).speed.setText(f"run {run.pair} of {pairs}: {len(run.tokens)} tokens{rate} (timing…)")

    def _on_error(self, rid: int, message: str) -> None:
        if rid in self._pending:
            self._errors.append(message)

    def _on_finished(self, rid: int) -> None:
        if rid not in self._pending:
            return
        self._pending.discard(rid)
        if self._pending:
            return
        self._status.cancel()
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        self.finished.emit(self._report())

    # -- the race ----------------------------------------------------------------------------------

    def start_replay(self) -> None:
        """Replay the median runs side by side from time 0 (also the Replay button)."""
        if self._chosen is None:
            return
        (base, spec) = self._chosen
        self.left.load_replay(base.tokens, base.steps, base.summary)
        self.right.load_replay(spec.tokens, spec.steps, spec.summary)
        self._replay_start = time.monotonic()
        self._replay.start()
        self._tick()

    def finish_replay(self) -> None:
        """Show both answers whole at once (the end of the race)."""
        if self._chosen is None:
            return
        self._replay.stop()
        self._show_at(float("inf"))

    def _tick(self) -> None:
        if self._show_at(self.race_clock):
            self._replay.stop()

    def _show_at(self, t: float) -> bool:
        done = self.left.show_until(t) & self.right.show_until(t)
        if done and self._diff is not None and not self._diff.identical:
            self.left.mark(self._diff.left_changed)
            self.right.mark(self._diff.right_changed)
        return done

    def _report(self) -> CompareResult:
        self._chosen = None
        stopped = any(cancel.is_set() for cancel in self._cancels)
        runs = [self._runs[rid] for rid in self._order]
        plain = [r for r in runs if r.side == "plain" and r.summary is not None]
        spec = [r for r in runs if r.side == "speculative" and r.summary is not None]
        # a stopped comparison is not raced: a cut run would read as a shorter, "different" answer
        complete = len(plain) == len(spec) == len(runs) // 2 and plain and not stopped
        if not complete:
            for pane in (self.left, self.right):
                pane.speed.setText("stopped" if stopped and not self._errors else "failed")
        if self._errors or not complete:
            firsts = (plain[0].summary if plain else None, spec[0].summary if spec else None)
            if stopped and not self._errors:
                self.result.setText("Stopped before both runs finished: nothing to compare.")
                if plain:
                    self.left.tokens = plain[0].tokens
                return CompareResult(*firsts, None, None, None, stopped=True)
            error = "; ".join(dict.fromkeys(self._errors)) or "A run did not finish."
            self.result.setText(f"<span style='color:#b00020'>Comparison failed: {error}</span>")
            return CompareResult(*firsts, None, None, None, error)
        base_run, spec_run = _median_run(plain), _median_run(spec)
        self._chosen = (base_run, spec_run)
        base, spec_summary = base_run.summary, spec_run.summary
        speedups = tuple(s.summary.tokens_per_s / p.summary.tokens_per_s if p.summary.tokens_per_s > 0 else 0.0
                         for p, s in zip(plain, spec))
        speedup = (spec_summary.tokens_per_s / base.tokens_per_s) if base.tokens_per_s > 0 else None
        steps = tuple(spec_run.steps)
        advice = advise(steps, verify_shape=self._verify_shape)
        predicted_k = predicted = None
        if advice is not None:
            drafting = [s.k for s in steps if s.drafted]
            predicted_k = self._predicted_k or max(1, round(sum(drafting) / len(drafting)))
            predicted = speedup_at(advice, predicted_k)
        n = len(plain)
        median = f" (median of {n} runs each, interleaved)" if n > 1 else " (1 run each)"
        parts = [
            f"Speedup <b>{speedup:.2f}×</b> measured{median}" if speedup else "Speedup n/a",
            f"τ = <b>{spec_summary.mean_accepted_length:.2f}</b>",
            f"acceptance {100 * spec_summary.acceptance_rate:.0f}%",
            f"{base.tokens_per_s:.1f} → {spec_summary.tokens_per_s:.1f} tok/s",
            f"{base.elapsed_s:.2f} s → {spec_summary.elapsed_s:.2f} s",
        ]
        if base_run.steps and spec_run.steps:
            parts.append(f"first token {base_run.steps[0].elapsed_s:.2f} s → {spec_run.steps[0].elapsed_s:.2f} s")
        if predicted is not None:
            adaptive = "" if self._predicted_k else ", mean of adaptive K"
            parts.insert(
                1,
                f"predicted <b>{predicted:.2f}×</b> at K={predicted_k}{adaptive} "
                f"(advisor's best: K={advice.best_k}, {speedup_at(advice, advice.best_k):.2f}×)",
            )
        elif any(s.tree for s in steps):
            parts.insert(1, "no prediction (token trees: the advisor models chains of K drafts)")
        diff = None
        if self._greedy:
            reference = [t.token_id for t in plain[0].tokens]
            diffs = [diff_tokens(reference, [t.token_id for t in r.tokens]) for r in (*plain, *spec)]
            diff = diff_tokens([t.token_id for t in base_run.tokens], [t.token_id for t in spec_run.tokens])
            if all(d.identical for d in diffs):
                parts.append("<span style='color:#1a7f37'><b>✓ identical outputs</b> (temperature 0"
                             f"{', every run' if n > 1 else ''})</span>")
            else:
                pairs = [(base_run, spec_run, diff)] + [(plain[0], r, d) for r, d in zip((*plain, *spec), diffs)]
                ref_run, other_run, shown = next(p for p in pairs if not p[2].identical)
                parts.append("<span style='color:#b00020'><b>✗ outputs differ</b> from token "
                             f"{shown.first_difference} (underlined){near_tie(ref_run, other_run, shown)}</span>")
        else:
            parts.append("sampled at temperature > 0: outputs may differ, the distribution does not")
        if "cancelled" in (base.stop_reason, spec_summary.stop_reason):
            parts.append("(stopped early)")
        if self.race_scale > 1:
            parts.append(f"replayed {self.race_scale:.1f}× faster than measured")
        self.result.setText(" · ".join(parts))
        self._diff = diff
        self.replay_button.setEnabled(True)
        self.start_replay()
        return CompareResult(
            base, spec_summary, speedup, spec_summary.mean_accepted_length, diff,
            advice=advice, predicted_k=predicted_k, predicted_speedup=predicted, speculative_steps=steps,
            runs=n, speedups=speedups,
        )


def near_tie(ref: _Run, other: _Run, diff: TokenDiff) -> str:
    """Where two greedy outputs first differ, the target's probability of each side's token there, each
    from its own run's target pass (on a GPU a verified block runs other kernels than one token, so a
    near-tie can flip: two close numbers say that; far-apart ones would say a bug)."""
    n = diff.first_difference
    if n is None or n >= min(len(ref.tokens), len(other.tokens)):
        return ""
    return (f": the target gave p={ref.tokens[n].p_target:.3f} to plain's token, "
            f"p={other.tokens[n].p_target:.3f} to this one")


def _median_run(runs: list[_Run]) -> _Run:
    """The run with the median decoding rate (the lower of the two middle ones for an even count)."""
    rates = sorted(runs, key=lambda r: r.summary.tokens_per_s)
    return rates[(len(rates) - 1) // 2]
