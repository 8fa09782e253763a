"""The main window: conversations (left), chat / compare (centre), plots (right), status bar."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QByteArray, QSettings, QStandardPaths, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QTabWidget,
    QToolButton,
    QVBoxLayout,
    QWidget,
)
from superqt.utils import qthrottled

from speclens.app.chat_view import ChatView, Legend, Message
from speclens.app.compare import ComparePanel, CompareResult
from speclens.app.history import HistoryStore, default_history_path, export_file_name
from speclens.app.plots import StepPlots, summary_text
from speclens.app.selftest_view import SelftestDialog
from speclens.app.settings import AppSettings, SettingsDialog, SettingsStore, config_dir, method_label
from speclens.app.worker import (
    SELFTEST_TRIALS,
    ContextUse,
    EngineFactory,
    GenerateRequest,
    LoadInfo,
    SelftestRequest,
    WorkerThread,
)
from speclens.engine.decoding.events import StepEvent, Summary, TokenEvent
from speclens.engine.tools.selftest import ChainVerifier, SelftestReport

log = logging.getLogger(__name__)

FLUSH_MS = 33  # at most ~30 redraws/s however fast tokens arrive
AUTOSAVE_MS = 1000


class PromptEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter inserts a newline."""

    submitted = Signal()

    def keyPressEvent(self, event) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


@dataclass
class _Answer:
    """The generation in flight (GUI-thread state only)."""

    request: GenerateRequest
    message_id: int
    settings: AppSettings
    tokens: list[TokenEvent]
    steps: list[StepEvent]
    summary: Summary | None = None
    error: str = ""
    saved_tokens: int = -1
    prompt_tokens: int | None = None  # as sent, after the overflow policy (ContextUse)


class MainWindow(QMainWindow):
    answer_finished = Signal(object)  # Message
    busy_changed = Signal(bool)
    selftest_finished = Signal(object)  # SelftestReport

    def __init__(
        self,
        settings_store: SettingsStore | None = None,
        history: HistoryStore | None = None,
        engine_factory: EngineFactory | None = None,
        preload: bool = True,
        settings: AppSettings | None = None,
    ) -> None:
        """`settings` overrides the stored settings for this session without saving them."""
        super().__init__()
        self.setWindowTitle("SpecLens")
        self.settings_store = settings_store or SettingsStore()
        self.settings = settings or self.settings_store.load()
        self.history, history_problem = (history, "") if history else _open_history()
        self._thread = WorkerThread(engine_factory, self)
        self.worker = self._thread.worker
        self._answer: _Answer | None = None
        self._pending: list[TokenEvent] = []
        self._pending_steps: list[StepEvent] = []
        self._conversation_id: int | None = None
        self._answer_steps: dict[int, tuple[tuple[StepEvent, ...], str]] = {}  # view index -> steps, caption
        self._loaded: LoadInfo | None = None
        self._dialog: SettingsDialog | None = None
        # the steps the speedup advisor measures: the last finished answer or comparison
        self._measured: tuple[tuple[StepEvent, ...], str] = ((), "")
        self._selftest: SelftestRequest | None = None
        self.selftest_dialog: SelftestDialog | None = None
        self._closing = False
        self._context_length: int | None = None  # the loaded target's, once a prompt reported it

        self._build_ui()
        problems = [history_problem] if history_problem else []
        if self.settings_store.problems:
            problems.append(f"Some settings in {self.settings_store.path} could not be used and are at their "
                            f"defaults: {'; '.join(self.settings_store.problems)}.")
        if problems:
            self.show_error("\n".join(problems))
        self._connect_worker()
        self._flush = qthrottled(self._flush_now, timeout=FLUSH_MS, leading=True, parent=self)
        self._autosave = QTimer(self, interval=AUTOSAVE_MS)
        self._autosave.timeout.connect(self._save_partial)
        self._refresh_conversations()
        conversations = self.history.conversations()
        if conversations:
            self.open_conversation(conversations[0].id)
        self._show_settings_in_status()
        self._restore_geometry()
        if preload:
            self.worker.request_load.emit(self.settings.model_settings())

    # -- construction ----------------------------------------------------------------------------

    def _build_ui(self) -> None:
        self.conversation_list = QListWidget()
        self.conversation_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conversation_list.customContextMenuRequested.connect(self._conversation_menu)
        self.conversation_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversation_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conversation_list.currentItemChanged.connect(self._conversation_clicked)
        new_chat = QPushButton("New chat")
        new_chat.clicked.connect(self.new_conversation)
        left = QWidget()
        left_layout = QVBoxLayout(left)
        left_layout.setContentsMargins(8, 8, 4, 8)
        title = QLabel("Conversations")
        title.setStyleSheet("font-weight: 600; color: #374151;")
        left_layout.addWidget(title)
        left_layout.addWidget(self.conversation_list, 1)
        left_layout.addWidget(new_chat)

        self.chat = ChatView()
        self.chat.answer_selected.connect(self._show_answer_plots)
        self.chat.regenerate_requested.connect(self.regenerate)
        self.hide_colours = QCheckBox("Hide colours")
        self.hide_colours.toggled.connect(self._toggle_colours)
        legend_row = QHBoxLayout()
        legend_row.addWidget(QLabel("Token source:"))
        legend_row.addWidget(Legend(), 1)
        legend_row.addWidget(self.hide_colours)
        self.error_banner = QLabel()
        self.error_banner.setWordWrap(True)
        self.error_banner.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.error_banner.setStyleSheet(
            "QLabel { background: #fdecea; color: #8a1c1c; border: 1px solid #f5c2c0;"
            " border-radius: 6px; padding: 6px 10px; }"
        )
        self.error_banner.hide()
        self.notice_banner = QLabel()  # what the context-overflow policy did to the last prompt
        self.notice_banner.setWordWrap(True)
        self.notice_banner.setStyleSheet(
            "QLabel { background: #fff8e1; color: #6b4e00; border: 1px solid #f3d98b;"
            " border-radius: 6px; padding: 6px 10px; }"
        )
        self.notice_banner.hide()
        self.input = PromptEdit()
        self.input.setPlaceholderText("Message the model — Enter sends, Shift+Enter for a new line")
        self.input.setFixedHeight(78)
        self.input.submitted.connect(self.send_from_input)
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.clicked.connect(self.send_from_input)
        self.stop_button = QPushButton("Stop")
        self.stop_button.setEnabled(False)
        self.stop_button.setShortcut(QKeySequence(Qt.Key.Key_Escape))  # only while enabled and on show
        self.stop_button.setToolTip("Stop generating (Esc)")
        self.stop_button.clicked.connect(self.stop)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addStretch(1)
        input_row = QHBoxLayout()
        input_row.addWidget(self.input, 1)
        input_row.addLayout(buttons)
        chat_page = QWidget()
        chat_layout = QVBoxLayout(chat_page)
        chat_layout.setContentsMargins(10, 10, 10, 10)
        chat_layout.addLayout(legend_row)
        chat_layout.addWidget(self.chat, 1)
        chat_layout.addWidget(self.notice_banner)
        chat_layout.addWidget(self.error_banner)
        chat_layout.addLayout(input_row)

        self.compare = ComparePanel(self.worker)
        self.compare.set_settings(self.settings)
        self.compare.started.connect(self._on_compare_started)
        self.compare.finished.connect(self._on_compare_finished)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(chat_page, "Chat")
        self.tabs.addTab(self.compare, "Compare")

        self.plots = StepPlots()

        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        self.splitter.addWidget(left)
        self.splitter.addWidget(self.tabs)
        self.splitter.addWidget(self.plots)
        self.splitter.setStretchFactor(0, 0)
        self.splitter.setStretchFactor(1, 3)
        self.splitter.setStretchFactor(2, 2)
        self.splitter.setSizes([220, 700, 560])
        self.setCentralWidget(self.splitter)

        self.status_model = QLabel("No model loaded")
        self.status_method = QLabel()
        self.status_k = QLabel()
        self.status_speed = QLabel("— tok/s")
        self.progress = QProgressBar()
        self.progress.setMaximumWidth(180)
        self.progress.setTextVisible(False)
        self.progress.hide()
        bar = self.statusBar()
        bar.addWidget(self.progress)
        self.status_context = QLabel("")  # the conversation's tokens against the model's context
        self.status_context.setToolTip("Tokens of this conversation (system prompt, turns, the last answer) "
                                       "against the tokens the model's context holds")
        for label in (self.status_model, self.status_method, self.status_k, self.status_context, self.status_speed):
            label.setContentsMargins(8, 0, 8, 0)
            bar.addPermanentWidget(label)

        settings_action = QAction("Settings…", self, shortcut=QKeySequence("Ctrl+,"))
        settings_action.triggered.connect(self.open_settings)
        new_action = QAction("New chat", self, shortcut=QKeySequence.StandardKey.New)
        new_action.triggered.connect(self.new_conversation)
        quit_action = QAction("Quit", self, shortcut=QKeySequence.StandardKey.Quit)
        quit_action.triggered.connect(self.close)
        self.selftest_action = QAction("Run exactness self-test…", self)
        self.selftest_action.triggered.connect(self.open_selftest)
        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction(new_action)
        file_menu.addAction(settings_action)
        file_menu.addSeparator()
        file_menu.addAction(quit_action)
        tools_menu = self.menuBar().addMenu("&Tools")
        tools_menu.addAction(self.selftest_action)
        settings_button = QToolButton()
        settings_button.setDefaultAction(settings_action)
        self.tabs.setCornerWidget(settings_button)

    def _connect_worker(self) -> None:
        w = self.worker
        w.progress.connect(self._on_progress)
        w.loaded.connect(self._on_loaded)
        w.load_failed.connect(self._on_load_failed)
        w.tokens.connect(self._on_tokens)
        w.step.connect(self._on_step)
        w.summary.connect(self._on_summary)
        w.context_use.connect(self._on_context_use)
        w.error.connect(self._on_error)
        w.finished.connect(self._on_finished)
        w.selftest_progress.connect(self._on_selftest_progress)
        w.selftest_done.connect(self._on_selftest_done)

    # -- public actions --------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._answer is not None

    def send_from_input(self) -> None:
        if self.send_message(self.input.toPlainText()):
            self.input.clear()

    def send_message(self, text: str) -> bool:
        """Store the user's message, then start generating with a snapshot of the settings."""
        text = text.strip()
        if not text or self.busy:
            return False
        snapshot = self.settings
        meta = _meta_line(snapshot, None)
        new_conversation = self._conversation_id is None
        try:
            self._conversation_id, message_id = self.history.start_exchange(
                self._conversation_id, _title_from(text), text, meta)
        except sqlite3.Error as exc:
            self._history_failed("your message", exc, "Nothing was sent: press Send again once it can be.")
            return False
        if new_conversation:
            self._refresh_conversations()
        self.chat.add_message(Message("user", text))
        self._start_answer(snapshot, meta, message_id)
        return True

    def regenerate(self) -> bool:
        """Answer the last question again with the current settings; the new answer replaces the
        last one, on screen and in the history."""
        messages = self.chat.messages
        if self.busy or self._conversation_id is None or not messages or messages[-1].role != "assistant":
            return False
        snapshot = self.settings
        meta = _meta_line(snapshot, None)
        try:
            message_id = self.history.restart_answer(self._conversation_id, meta)
        except sqlite3.Error as exc:
            self._history_failed("the new answer", exc, "Nothing was changed: try again once it can be.")
            return False
        self.chat.remove_last()
        self._answer_steps.pop(len(messages) - 1, None)
        self._start_answer(snapshot, meta, message_id)
        return True

    def _start_answer(self, snapshot: AppSettings, meta: str, message_id: int) -> None:
        """Generate an answer to the transcript as it stands, into stored message `message_id`."""
        context = snapshot.conversation(model_context(self.chat.messages))
        request = self.worker.new_request(snapshot.model_settings(), context, snapshot.generation_config(),
                                          overflow=snapshot.context_overflow)
        self._answer = _Answer(request, message_id, snapshot, [], [])
        self.chat.begin_answer(meta + " · generating…")
        self.plots.clear()
        self.error_banner.hide()
        self.notice_banner.hide()
        self._set_busy(True)
        self._autosave.start()
        self.worker.request_generate.emit(request)

    def stop(self) -> None:
        if self._answer is not None:
            self._answer.request.cancel.set()
            self.stop_button.setEnabled(False)
        self.compare.stop()

    def run_compare(self, prompt: str) -> None:
        self.tabs.setCurrentWidget(self.compare)
        self.compare.prompt.setText(prompt)
        self.compare.run(prompt)

    def apply_settings(self, settings: AppSettings, persist: bool = True) -> None:
        """Use `settings` from the next message on; the generation in flight keeps its snapshot."""
        self.settings = settings
        if persist:
            self.settings_store.save(settings)
        self.compare.set_settings(settings)
        self._show_settings_in_status()

    def settings_dialog(self) -> SettingsDialog:
        """A settings dialog on the current settings, the loaded engine's methods and the advisor's
        measurement; `open_settings` runs it modally."""
        steps, source = self._measured
        methods = self._loaded.methods if self._loaded else None
        shape = self._loaded.verify_shape if self._loaded else None
        dialog = SettingsDialog(self.settings, self, methods=methods, steps=steps, steps_source=source,
                                verify_shape=shape)
        dialog.check_requested.connect(lambda s: self.worker.request_load.emit(s.model_settings()))
        if self._loaded and self._loaded.settings == self.settings.model_settings():
            self._show_report(dialog, self._loaded)
        return dialog

    def open_settings(self) -> None:
        dialog = self.settings_dialog()
        self._dialog = dialog
        try:
            if dialog.exec():
                self.apply_settings(dialog.settings())
        finally:
            self._dialog = None

    def open_selftest(self) -> SelftestDialog:
        if self.selftest_dialog is None:
            self.selftest_dialog = SelftestDialog(self)
            self.selftest_dialog.run_requested.connect(self.run_selftest)
        self.selftest_dialog.show()
        self.selftest_dialog.raise_()
        return self.selftest_dialog

    def run_selftest(self, trials: int = SELFTEST_TRIALS, verify: ChainVerifier | None = None) -> bool:
        """Queue an exactness self-test on the worker thread (the loaded models, or the configured
        ones loaded first); `verify` swaps the chain verifier under test. False if one is running."""
        if self._selftest is not None:
            return False
        dialog = self.open_selftest()
        self._selftest = SelftestRequest(self.settings.model_settings(), self.worker.next_id(), trials, verify)
        self.selftest_action.setEnabled(False)
        dialog.begin(trials)
        self.worker.request_selftest.emit(self._selftest)
        return True

    def new_conversation(self) -> None:
        if self.busy:
            return
        self._conversation_id = None
        self.chat.set_messages(())
        self._answer_steps.clear()
        self.plots.set_steps(())
        self.conversation_list.blockSignals(True)
        self.conversation_list.clearSelection()
        self.conversation_list.setCurrentItem(None)
        self.conversation_list.blockSignals(False)
        self.input.setFocus()

    def open_conversation(self, conversation_id: int) -> None:
        if self.busy:
            return
        self._conversation_id = conversation_id
        self._answer_steps.clear()
        messages = []
        try:
            stored_messages = self.history.messages(conversation_id)
        except sqlite3.Error as exc:
            self.show_error(f"Could not read this chat from the history ({exc}).")
            return
        for stored in stored_messages:
            error = stored.error or ("" if stored.complete else "(interrupted)")
            if stored.steps:
                self._answer_steps[len(messages)] = (stored.steps, stored.meta)
            messages.append(Message(stored.role, stored.content, stored.tokens, stored.meta, error))
        self.chat.set_messages(messages)
        last = max(self._answer_steps, default=None)
        self.plots.set_steps(*self._answer_steps.get(last, ((), "")))
        if last is not None:
            steps, meta = self._answer_steps[last]
            self._measured = (steps, f"the last answer of this conversation ({meta})")
        self._select_in_list(conversation_id)

    # -- worker signals --------------------------------------------------------------------------

    def _mine(self, rid: int) -> bool:
        return self._answer is not None and self._answer.request.id == rid

    def _on_progress(self, message: str, fraction: float | None) -> None:
        self.statusBar().showMessage(message)
        self.progress.show()
        if fraction is None:
            self.progress.setRange(0, 0)
        else:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * fraction))

    def _on_loaded(self, info: LoadInfo) -> None:
        self._loaded = info
        self.progress.hide()
        self.statusBar().showMessage(f"Loaded {info.description}", 5000)
        self.status_model.setText(info.description)
        self.status_model.setToolTip("\n".join([*info.compat_lines, *info.drafters]))
        if info.unfit:  # drafter folders made for another target: left out, and said once here
            unfit = [line.removeprefix("✗ ") for line in info.drafters if line.startswith("✗")]
            self.notice_banner.setText(f"Left out {info.unfit} drafter folder{'s' * (info.unfit > 1)} made for another "
                                       f"model: " + "; ".join(unfit))
            self.notice_banner.show()
        if info.settings == self.settings.model_settings() and self.settings.method not in info.methods:
            self.show_error(
                f"Method '{self.settings.method}' is not offered by {info.description} "
                f"(available: {', '.join(info.methods)}). Choose one in Settings."
            )
        if self._dialog is not None:
            self._show_report(self._dialog, info)
            self._dialog.set_methods(info.methods)

    def _on_load_failed(self, message: str) -> None:
        self._loaded = None
        self.progress.hide()
        self.status_model.setText("Model failed to load")
        self.statusBar().showMessage("Model failed to load", 10000)
        self.show_error(f"Could not load the model: {message}")
        if self._dialog is not None:
            self._dialog.show_report(False, (message,))

    def _on_tokens(self, rid: int, tokens: tuple[TokenEvent, ...]) -> None:
        if self._mine(rid):
            self._answer.tokens.extend(tokens)
            self._pending.extend(tokens)
            self._flush()

    def _on_step(self, rid: int, step: StepEvent) -> None:
        if self._mine(rid):
            self._answer.steps.append(step)
            self._pending_steps.append(step)
            self._flush()

    def _on_summary(self, rid: int, summary: Summary) -> None:
        if self._mine(rid):
            self._answer.summary = summary

    def _on_context_use(self, rid: int, use: ContextUse) -> None:
        if not self._mine(rid):
            return
        self._answer.prompt_tokens = use.tokens
        self._context_length = use.context
        self._show_context(use.tokens)
        if use.notice:
            self.notice_banner.setText(use.notice)
            self.notice_banner.show()

    def _show_context(self, tokens: int) -> None:
        if self._context_length:
            self.status_context.setText(f"context {tokens:,} / {self._context_length:,}")
        else:
            self.status_context.setText(f"context {tokens:,} tokens")

    def _on_error(self, rid: int, message: str) -> None:
        if self._mine(rid):
            self._answer.error = message
            self.show_error(message)

    def _on_finished(self, rid: int) -> None:
        if not self._mine(rid):
            return
        self._flush.cancel()
        self._flush_now()
        answer = self._answer
        self._answer = None
        self._autosave.stop()
        text = "".join(t.text for t in answer.tokens)
        meta = _meta_line(answer.settings, answer.summary, answer.steps)
        error = answer.error
        if answer.summary and answer.summary.stop_reason == "cancelled":
            error = error or "(stopped)"
        message = Message("assistant", text, tuple(answer.tokens), meta, error)
        self.chat.finish_answer(message)
        try:
            self.history.update_message(
                answer.message_id, text, answer.tokens, answer.steps, meta=meta, error=error, complete=True
            )
        except sqlite3.Error as exc:
            self._history_failed("the answer", exc, "It stays in this window until you open another chat.")
        caption = summary_text(answer.summary) if answer.summary else meta
        self._answer_steps[len(self.chat.messages) - 1] = (tuple(answer.steps), caption)
        if answer.steps:
            self._measured = (tuple(answer.steps), f"the last answer ({meta})")
        if answer.prompt_tokens is not None:
            self._show_context(answer.prompt_tokens + len(answer.tokens))
        if answer.summary:
            self.plots.set_summary(answer.summary)
            self.status_speed.setText(f"{answer.summary.tokens_per_s:.1f} tok/s")
        self.plots.redraw()
        self._set_busy(False)
        self._refresh_conversations()
        self.answer_finished.emit(message)

    def _on_compare_started(self, caption: str) -> None:
        if not self.busy:  # the chat answer in flight owns the plots
            self.plots.clear()
            self.plots.set_caption(caption)

    def _on_compare_finished(self, result: CompareResult) -> None:
        if result.speculative_steps:
            method = result.speculative.method if result.speculative else "speculative"
            self._measured = (result.speculative_steps, f"the last comparison ({method})")
        if not self.busy:
            self.plots.set_steps(result.speculative_steps)
            if result.speculative is not None:
                self.plots.set_summary(result.speculative)
            else:
                self.plots.set_caption("Comparison stopped" if result.stopped else f"Comparison failed: {result.error}")

    def _on_selftest_progress(self, rid: int, message: str, fraction: float | None) -> None:
        if self._selftest is not None and rid == self._selftest.id and self.selftest_dialog is not None:
            self.selftest_dialog.show_progress(message, fraction)

    def _on_selftest_done(self, rid: int, report: SelftestReport) -> None:
        if self._selftest is None or rid != self._selftest.id:
            return
        self._selftest = None
        self.selftest_action.setEnabled(True)
        if self.selftest_dialog is not None:
            self.selftest_dialog.show_report(report)
        self.statusBar().showMessage(f"Exactness self-test: {'PASS' if report.passed else 'FAIL'}", 10000)
        self.selftest_finished.emit(report)

    # -- helpers ---------------------------------------------------------------------------------

    def _flush_now(self) -> None:
        """Push buffered tokens and steps to the widgets (throttled to FLUSH_MS)."""
        if self._pending:
            self.chat.append_tokens(self._pending)
            self._pending = []
        if self._pending_steps:
            last = self._pending_steps[-1]
            self.plots.add_steps(self._pending_steps)
            self._pending_steps = []
            if last.decode_s > 0:
                self.status_speed.setText(f"{last.new_tokens / last.decode_s:.1f} tok/s")

    def _save_partial(self) -> None:
        answer = self._answer
        if answer is None or len(answer.tokens) == answer.saved_tokens:
            return
        text = "".join(t.text for t in answer.tokens)
        try:
            self.history.update_message(answer.message_id, text, answer.tokens, answer.steps, complete=False)
        except sqlite3.Error as exc:
            self._history_failed("the answer so far", exc, "It is tried again in a moment.")
            return
        answer.saved_tokens = len(answer.tokens)

    def show_error(self, message: str) -> None:
        self.error_banner.setText(message)
        self.error_banner.show()

    def _history_failed(self, what: str, exc: sqlite3.Error, consequence: str) -> None:
        where = self.history.path or "memory"
        self.show_error(f"Could not save {what} to the chat history ({exc}; {where}). {consequence} "
                        "Is another program using the history file?")

    def _set_busy(self, busy: bool) -> None:
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)
        self.conversation_list.setEnabled(not busy)
        self.busy_changed.emit(busy)

    def _toggle_colours(self, hidden: bool) -> None:
        self.chat.set_colours(not hidden)
        self.compare.left.colours = self.compare.right.colours = not hidden

    def _show_settings_in_status(self) -> None:
        s = self.settings
        self.status_method.setText(f"Method: {s.method}")  # short: the status bar also shows messages
        self.status_method.setToolTip(method_label(s.method))
        self.status_k.setText(f"K ≤ {s.k} (adaptive)" if s.adaptive_k else f"K = {s.k}")
        self.status_k.setVisible(s.method != "ar")

    def _show_answer_plots(self, index: int) -> None:
        if index in self._answer_steps:
            self.plots.set_steps(*self._answer_steps[index])

    @staticmethod
    def _show_report(dialog: SettingsDialog, info: LoadInfo) -> None:
        if info.compat_ok is None:
            dialog.show_report(None, (info.description,), info.drafters)
        else:
            dialog.show_report(info.compat_ok, info.compat_lines, info.drafters)

    def _refresh_conversations(self) -> None:
        self.conversation_list.blockSignals(True)
        self.conversation_list.clear()
        try:
            conversations = self.history.conversations()
        except sqlite3.Error as exc:
            conversations = []
            self.show_error(f"Could not read the list of chats from the history ({exc}).")
        for conversation in conversations:
            item = QListWidgetItem(conversation.title)
            item.setData(Qt.ItemDataRole.UserRole, conversation.id)
            item.setToolTip(conversation.title)
            self.conversation_list.addItem(item)
        self.conversation_list.blockSignals(False)
        if self._conversation_id is not None:
            self._select_in_list(self._conversation_id)

    def _select_in_list(self, conversation_id: int) -> None:
        self.conversation_list.blockSignals(True)
        for row in range(self.conversation_list.count()):
            item = self.conversation_list.item(row)
            if item.data(Qt.ItemDataRole.UserRole) == conversation_id:
                self.conversation_list.setCurrentItem(item)
        self.conversation_list.blockSignals(False)

    def _conversation_clicked(self, item: QListWidgetItem | None, _previous=None) -> None:
        if item is not None:
            self.open_conversation(item.data(Qt.ItemDataRole.UserRole))

    def _conversation_menu(self, point) -> None:
        item = self.conversation_list.itemAt(point)
        if item is None or self.busy:
            return
        cid = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self._rename(cid, item.text()))
        menu.addAction("Export as Markdown…", lambda: self._export(cid, "md"))
        menu.addAction("Export as JSON…", lambda: self._export(cid, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_conversation(cid))
        menu.exec(self.conversation_list.mapToGlobal(point))

    def _rename(self, cid: int, current: str) -> None:
        title, ok = QInputDialog.getText(self, "Rename conversation", "Title:", text=current)
        if ok and title.strip():
            try:
                self.history.rename(cid, title.strip())
            except sqlite3.Error as exc:
                self._history_failed("the new title", exc, "The chat keeps its old one.")
            self._refresh_conversations()

    def delete_conversation(self, cid: int) -> None:
        try:
            self.history.delete(cid)
        except sqlite3.Error as exc:
            self._history_failed("the deletion", exc, "The chat is still there.")
            return
        if cid == self._conversation_id:
            self.new_conversation()
        self._refresh_conversations()

    def _export(self, cid: int, kind: str) -> None:
        suffix = {"md": "Markdown (*.md)", "json": "JSON (*.json)"}[kind]
        try:
            title = self.history.title(cid)
        except sqlite3.Error as exc:
            self.show_error(f"Could not read this chat from the history ({exc}).")
            return
        # a name only (the title is the user's text: no separators), in the last export folder or Documents
        default = self._export_folder() / export_file_name(title, kind)
        path, _ = QFileDialog.getSaveFileName(self, "Export conversation", str(default), suffix)
        if path:
            self.export_to(cid, kind, Path(path))

    def export_to(self, cid: int, kind: str, path: Path) -> bool:
        """Write the conversation to `path` (the user chose it); any failure is a banner, not a crash."""
        try:
            text = self.history.export_markdown(cid) if kind == "md" else self.history.export_json(cid)
            path.write_text(text, encoding="utf-8")
        except (sqlite3.Error, OSError, ValueError) as exc:
            self.show_error(f"Could not export the chat to {path}: {exc}")
            return False
        self._qsettings().setValue("export_folder", str(path.parent))
        self.statusBar().showMessage(f"Exported to {path}", 5000)
        return True

    def _export_folder(self) -> Path:
        last = self._qsettings().value("export_folder")
        if isinstance(last, str) and last and Path(last).is_dir():
            return Path(last)
        documents = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.DocumentsLocation)
        return Path(documents) if documents and Path(documents).is_dir() else Path.home()

    def _qsettings(self) -> QSettings:
        return QSettings(str(config_dir() / "window.ini"), QSettings.Format.IniFormat)

    def _restore_geometry(self) -> None:
        stored = self._qsettings()
        geometry = stored.value("geometry")
        if isinstance(geometry, QByteArray) and self.restoreGeometry(geometry):
            splitter = stored.value("splitter")
            if isinstance(splitter, QByteArray):
                self.splitter.restoreState(splitter)
        else:
            self.resize(1440, 900)

    def closeEvent(self, event) -> None:
        if self._answer is not None:
            self._answer.request.cancel.set()
            self._save_partial()
        self.compare.stop()
        if self._selftest is not None:
            self._selftest.cancel.set()
        stored = self._qsettings()
        stored.setValue("geometry", self.saveGeometry())
        stored.setValue("splitter", self.splitter.saveState())
        stored.sync()
        if not self._thread.stop():
            log.warning("closing while a model load cannot be interrupted; the app leaves without it")
        super().closeEvent(event)

    def engine_thread_running(self) -> bool:
        """After closing: whether the model thread is still inside a load it could not stop (app.main
        then leaves the process at once, since destroying a running QThread aborts it)."""
        return self._thread.thread.isRunning()


def _open_history() -> tuple[HistoryStore, str]:
    """The history file, and what to tell the user when it could not be used as it was."""
    path = default_history_path()
    try:
        store = HistoryStore(path)
    except (sqlite3.Error, OSError) as exc:
        store = HistoryStore.in_memory(copy_of=path)
        earlier = " The earlier chats are shown from a copy." if store.conversations() else ""
        return store, (f"The chat history could not be opened for writing ({exc}; {path}): this session's chats "
                       f"are kept only until SpecLens closes.{earlier}")
    if store.moved_aside is not None:
        return store, (f"The chat history file could not be read, so a new one was started; the old file "
                       f"was kept as {store.moved_aside}.")
    return store, ""


def model_context(messages: Sequence[Message]) -> tuple[tuple[str, str], ...]:
    """The (role, text) turns the model is given: every message with text, except a user turn whose
    answer failed before its first token (the model did not load, say), which would otherwise be sent
    again with every later question."""
    turns = []
    for i, message in enumerate(messages):
        answer = messages[i + 1] if i + 1 < len(messages) else None
        unanswered = answer is not None and answer.role == "assistant" and not answer.text and answer.error
        if message.text and not (message.role == "user" and unanswered):
            turns.append((message.role, message.text))
    return tuple(turns)


def _title_from(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= 48 else line[:47] + "…"


def _meta_line(settings: AppSettings, summary: Summary | None, steps: Sequence[StepEvent] = ()) -> str:
    # once answered, the method that ran ("auto" resolves to the loaded models' best)
    name = summary.method if summary is not None and summary.method else settings.method
    method = name if name == "ar" else f"{name}, K={settings.k}"
    if name != "ar" and settings.adaptive_k:
        method += " (adaptive)"
    parts = [method, f"T={settings.temperature:g}"]
    if summary is not None:
        parts += [f"{summary.new_tokens} tokens", f"{summary.tokens_per_s:.1f} tok/s"]
        if summary.steps:
            parts.append(f"τ {summary.mean_accepted_length:.2f}")
        if steps:  # the first step emits the first token: prefill and that step, apart from the decoding rate
            parts.append(f"first token {steps[0].elapsed_s:.2f} s")
    return " · ".join(parts)
