"""Shared helpers for the app tests: isolated config/data folders and tiny-engine factories."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pyqtgraph as pg
import pytest
from PySide6.QtCore import QEvent
from PySide6.QtWidgets import QApplication

from speclens.engine.decoding.events import StepEvent
from speclens.engine.session import Engine, EngineError, ModelSettings
from tests.tiny import make_tiny_engine

# pyqtgraph's atexit sweep touches Qt objects during interpreter shutdown and can abort the run
pg.setConfigOptions(exitCleanup=False)


class SlowEngine:
    """Wraps a real engine and pauses after every verification step, so a test can act mid-answer.

    `steps_after_cancel` counts the StepEvents that still came out once `cancel` was set."""

    def __init__(self, engine: Engine, step_delay_s: float) -> None:
        self._engine = engine
        self._delay = step_delay_s
        self.steps_after_cancel = 0
        self.cancel_seen = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def chat(self, messages, config, cancel=None) -> Iterator:
        return self.generate_ids(self._engine.encode_chat(messages), config, cancel)

    def generate_ids(self, ids, config, cancel=None) -> Iterator:
        for event in self._engine.generate_ids(ids, config, cancel):
            if isinstance(event, StepEvent):
                if cancel is not None and cancel.is_set():
                    self.steps_after_cancel += 1
                time.sleep(self._delay)
            yield event


def tiny_factory(draft: bool = True, step_delay_s: float = 0.0, loads: list | None = None):
    def factory(settings: ModelSettings, progress) -> Engine:
        progress("Building tiny models", None)
        if loads is not None:
            loads.append(settings)
        engine = make_tiny_engine(draft=draft)
        return SlowEngine(engine, step_delay_s) if step_delay_s else engine

    return factory


def failing_factory(message: str = "No such model: nowhere/nothing"):
    def factory(settings: ModelSettings, progress) -> Engine:
        progress("Looking for the model", 0.1)
        raise EngineError(message)

    return factory


@pytest.fixture
def app_dirs(tmp_path, monkeypatch):
    config, data = tmp_path / "config", tmp_path / "data"
    monkeypatch.setenv("SPECLENS_CONFIG_DIR", str(config))
    monkeypatch.setenv("SPECLENS_DATA_DIR", str(data))
    return config, data


@pytest.fixture
def make_window(qtbot, app_dirs):
    """Opens MainWindows on tiny engines and closes them (joining the worker thread) afterwards:
    pytest-qt keeps only weak references, and a window deleted without closing would destroy a
    running QThread."""
    from speclens.app.window import MainWindow

    windows = []

    def make(factory, preload: bool = False, **kwargs):
        window = MainWindow(engine_factory=factory, preload=preload, **kwargs)
        windows.append(window)
        qtbot.addWidget(window)
        window.resize(1280, 800)
        window.show()
        return window

    yield make
    for window in windows:
        window.close()
        window.deleteLater()
    QApplication.sendPostedEvents(None, QEvent.Type.DeferredDelete.value)


def send_and_wait(qtbot, window, text: str, timeout_ms: int = 60_000):
    with qtbot.waitSignal(window.answer_finished, timeout=timeout_ms) as blocker:
        assert window.send_message(text)
    return blocker.args[0]


def record_requests(window) -> list:
    """The GenerateRequests the window (chat and Compare) makes from now on, in order."""
    made, new_request = [], window.worker.new_request

    def recording(*args, **kwargs):
        made.append(new_request(*args, **kwargs))
        return made[-1]

    window.worker.new_request = recording
    return made
