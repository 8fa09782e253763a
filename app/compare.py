"""Side-by-side mode: the same prompt and seed decoded plainly (left) then speculatively (right).

Both runs go to the one worker, which serialises them, so they never compete for the device.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QSize, Qt, Signal
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

from speclens.app.chat_view import token_format
from speclens.app.settings import AppSettings
from speclens.app.stats import TokenDiff, advise, diff_tokens, speedup_at
from speclens.app.worker import EngineWorker
from speclens.engine.decoding.advisor import Advice
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
    speculative_step = Signal(object)  # StepEvent of the speculative side, for the plot panel

    def __init__(self, worker: EngineWorker, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._worker = worker
        self._settings = AppSettings()
        self._requests: dict[int, ComparePane] = {}
        self._summaries: dict[int, Summary] = {}
        self._errors: list[str] = []
        self._greedy = True
        self._order: tuple[int, int] | None = None
        self._cancels: tuple = ()
        self._spec_steps: list[StepEvent] = []
        self._predicted_k: int | None = None
        self._spec_label = ""  # "K≤4 adaptive, seed 7": the right pane's title after its method

        self.prompt = QLineEdit()
        self.prompt.setPlaceholderText("One prompt, run plainly and speculatively with the same seed…")
        self.prompt.returnPressed.connect(self._run_clicked)
        self.run_button = QPushButton("Compare")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(self._run_clicked)
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
        return bool(self._requests)

    def set_settings(self, settings: AppSettings) -> None:
        self._settings = settings

    def run(self, prompt: str) -> None:
        if self.busy or not prompt.strip():
            return
        snapshot = self._settings
        seed = snapshot.seed if snapshot.seed >= 0 else random.randrange(2**31)
        method = snapshot.method if snapshot.method != "ar" else "lookup"
        messages = snapshot.conversation((("user", prompt.strip()),))
        seeded = replace(snapshot, seed=seed)
        model = seeded.model_settings()
        left = self._worker.new_request(model, messages, seeded.generation_config("ar"), tag="compare")
        right = self._worker.new_request(model, messages, seeded.generation_config(method), tag="compare")
        self._greedy = snapshot.temperature == 0.0
        self._predicted_k = None if snapshot.adaptive_k else snapshot.k
        self._spec_steps = []
        self._summaries.clear()
        self._errors.clear()
        self._requests = {left.id: self.left, right.id: self.right}
        self._order = (left.id, right.id)
        self._cancels = (left.cancel, right.cancel)
        self.left.reset()
        self.right.reset()
        k = f"K≤{snapshot.k} adaptive" if snapshot.adaptive_k else f"K={snapshot.k}"
        self._spec_label = f"{k}, seed {seed}"
        self.right.title.setText(f"Speculative ({method}, {self._spec_label})")
        self.left.title.setText(f"Plain autoregressive (seed {seed})")
        self.result.setText("Running the plain baseline, then the speculative decoder…")
        self.started.emit(f"Comparing: plain, then {method} ({k})…")
        self.run_button.setEnabled(False)
        self.stop_button.setEnabled(True)
        self._worker.request_generate.emit(left)
        self._worker.request_generate.emit(right)

    def stop(self) -> None:
        for cancel in self._cancels:
            cancel.set()

    def _run_clicked(self) -> None:
        self.run(self.prompt.text())

    def _on_tokens(self, rid: int, tokens: tuple[TokenEvent, ...]) -> None:
        if rid in self._requests:
            self._requests[rid].append(tokens)

    def _on_step(self, rid: int, step: StepEvent) -> None:
        if rid in self._requests:
            self._requests[rid].show_step(step)
            if self._order and rid == self._order[1]:
                self._spec_steps.append(step)
                self.speculative_step.emit(step)

    def _on_summary(self, rid: int, summary: Summary) -> None:
        if rid in self._requests:
            self._summaries[rid] = summary
            self._requests[rid].show_summary(summary)
            if self._order and rid == self._order[1] and summary.method:
                # "auto" resolves to the loaded models' best: name the method that ran
                self.right.title.setText(f"Speculative ({summary.method}, {self._spec_label})")

    def _on_error(self, rid: int, message: str) -> None:
        if rid in self._requests:
            self._errors.append(message)

    def _on_finished(self, rid: int) -> None:
        if rid not in self._requests:
            return
        del self._requests[rid]
        if self._requests:
            return
        self.run_button.setEnabled(True)
        self.stop_button.setEnabled(False)
        left_id, right_id = self._order
        self.finished.emit(self._report(self._summaries.get(left_id), self._summaries.get(right_id)))

    def _report(self, base: Summary | None, spec: Summary | None) -> CompareResult:
        stopped = any(cancel.is_set() for cancel in self._cancels)
        if stopped and not self._errors and (base is None or spec is None):
            self.result.setText("Stopped before both runs finished: nothing to compare.")
            return CompareResult(base, spec, None, None, None, stopped=True)
        if self._errors or base is None or spec is None:
            error = "; ".join(self._errors) or "A run did not finish."
            self.result.setText(f"<span style='color:#b00020'>Comparison failed: {error}</span>")
            return CompareResult(base, spec, None, None, None, error)
        speedup = spec.tokens_per_s / base.tokens_per_s if base.tokens_per_s > 0 else None
        steps = tuple(self._spec_steps)
        advice = advise(steps)
        predicted_k = predicted = None
        if advice is not None:
            drafting = [s.k for s in steps if s.drafted]
            predicted_k = self._predicted_k or max(1, round(sum(drafting) / len(drafting)))
            predicted = speedup_at(advice, predicted_k)
        diff = None
        parts = [
            f"Speedup <b>{speedup:.2f}×</b> measured" if speedup else "Speedup n/a",
            f"τ = <b>{spec.mean_accepted_length:.2f}</b>",
            f"acceptance {100 * spec.acceptance_rate:.0f}%",
            f"{base.tokens_per_s:.1f} → {spec.tokens_per_s:.1f} tok/s",
        ]
        if predicted is not None:
            adaptive = "" if self._predicted_k else ", mean of adaptive K"
            parts.insert(
                1,
                f"predicted <b>{predicted:.2f}×</b> at K={predicted_k}{adaptive} "
                f"(advisor's best: K={advice.best_k}, {speedup_at(advice, advice.best_k):.2f}×)",
            )
        elif any(s.tree for s in steps):
            parts.insert(1, "no prediction (token trees: the advisor models chains of K drafts)")
        if self._greedy:
            diff = diff_tokens([t.token_id for t in self.left.tokens], [t.token_id for t in self.right.tokens])
            if diff.identical:
                parts.append("<span style='color:#1a7f37'><b>✓ identical outputs</b> (temperature 0)</span>")
            else:
                self.left.mark(diff.left_changed)
                self.right.mark(diff.right_changed)
                parts.append(
                    "<span style='color:#b00020'><b>✗ outputs differ</b> from token "
                    f"{diff.first_difference} (underlined)</span>"
                )
        else:
            parts.append("sampled at temperature > 0: outputs may differ, the distribution does not")
        if "cancelled" in (base.stop_reason, spec.stop_reason):
            parts.append("(stopped early)")
        self.result.setText(" · ".join(parts))
        return CompareResult(
            base, spec, speedup, spec.mean_accepted_length, diff,
            advice=advice, predicted_k=predicted_k, predicted_speedup=predicted, speculative_steps=steps,
        )
