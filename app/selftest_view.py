"""The exactness self-test dialog: the run itself happens on the engine worker's thread; this only
asks for it, shows progress and renders the report."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from speclens.app.worker import SELFTEST_TRIALS
from speclens.engine.tools.selftest import SelftestReport

INTRO = (
    "Checks that speculative decoding is exact on this machine: the verifiers' output distributions "
    "against the target's (chi-square and per-token deviation over many samples of random "
    "distributions), then greedy decoding with every method the loaded models offer against plain "
    "decoding, token for token. Each line of the report names one check and its sample count."
)


class SelftestDialog(QDialog):
    run_requested = Signal(int)  # samples per chain check

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Exactness self-test")
        self.setMinimumSize(640, 420)
        self.report: SelftestReport | None = None
        intro = QLabel(INTRO)
        intro.setWordWrap(True)
        self.trials = QSpinBox(minimum=1024, maximum=1_048_576, singleStep=4096)
        self.trials.setValue(SELFTEST_TRIALS)
        self.trials.setToolTip("More samples detect smaller deviations but take longer.")
        form = QFormLayout()
        form.addRow("Samples per verifier check", self.trials)
        self.run_button = QPushButton("Run self-test")
        self.run_button.setDefault(True)
        self.run_button.clicked.connect(lambda: self.run_requested.emit(self.trials.value()))
        self.progress = QProgressBar()
        self.progress.setTextVisible(False)
        self.progress.hide()
        self.stage = QLabel()
        self.stage.setStyleSheet("color: #4b5563;")
        self.verdict = QLabel()
        self.verdict.setTextFormat(Qt.TextFormat.RichText)
        self.lines = QPlainTextEdit(readOnly=True)
        self.lines.setPlaceholderText("The report appears here.")
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        row = QHBoxLayout()
        row.addLayout(form, 1)
        row.addWidget(self.run_button)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addWidget(intro)
        layout.addLayout(row)
        layout.addWidget(self.progress)
        layout.addWidget(self.stage)
        layout.addWidget(self.verdict)
        layout.addWidget(self.lines, 1)
        layout.addLayout(buttons)

    def begin(self, trials: int) -> None:
        self.report = None
        self.trials.setValue(trials)
        self.run_button.setEnabled(False)
        self.verdict.clear()
        self.lines.clear()
        self.progress.setRange(0, 0)
        self.progress.show()
        self.stage.setText(f"Running with {trials} samples per verifier check…")

    def show_progress(self, message: str, fraction: float | None) -> None:
        if fraction is None:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * fraction))
        self.stage.setText(message)

    def show_report(self, report: SelftestReport) -> None:
        self.report = report
        self.progress.hide()
        self.stage.clear()
        self.run_button.setEnabled(True)
        failed = sum(1 for line in report.lines if line.startswith("FAIL"))
        if report.passed:
            self.verdict.setText(
                f"<span style='color:#1a7f37; font-size:14pt'><b>PASS</b></span> — all "
                f"{len(report.lines)} checks passed"
            )
        else:
            self.verdict.setText(
                f"<span style='color:#b00020; font-size:14pt'><b>FAIL</b></span> — {failed} of "
                f"{len(report.lines)} checks failed: speculative output is not exact"
            )
        self.lines.setPlainText("\n".join(report.lines))
