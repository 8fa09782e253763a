"""The Qt binding itself: the calls the window makes by the thousand must leave the interpreter intact."""

from __future__ import annotations

import sys

from PySide6.QtWidgets import QLabel


def test_qt_calls_that_return_nothing_keep_none_alive(qtbot):
    """PySide6 6.12.0 dropped a reference to None on every call that returns nothing; on Python 3.10-3.11
    None's count then reaches zero and the app aborts (none_dealloc) minutes into a chat. pyproject.toml
    excludes that release; this catches the next one that does the same. (From Python 3.12 None is
    immortal and its count never moves.)"""
    label = QLabel()
    qtbot.addWidget(label)
    calls = min(2000, sys.getrefcount(None) // 8)  # few enough that a leaking binding cannot abort the run
    before = sys.getrefcount(None)
    for _ in range(calls):
        label.setText("x")
        label.setEnabled(True)
    assert sys.getrefcount(None) > before - calls // 10, f"None lost {before - sys.getrefcount(None)} references"
