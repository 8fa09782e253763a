"""The SQLite history: CRUD, export, reload with colours, and surviving SIGKILL mid-answer."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from PySide6.QtGui import QTextCursor

from app.chat_view import SOURCE_PROPERTY
from app.history import HistoryStore
from app.settings import AppSettings
from engine.events import StepEvent, TokenEvent
from tests.app_fixtures import app_dirs, make_window, send_and_wait, tiny_factory  # noqa: F401 (fixtures)

ROOT = Path(__file__).resolve().parents[1]


def test_store_round_trip_rename_delete_export(app_dirs):
    _, data = app_dirs
    store = HistoryStore()
    assert store.path.parent == data
    cid = store.create_conversation("Paris")
    store.add_message(cid, "user", "Capital of France?")
    mid = store.add_message(cid, "assistant", "", complete=False)
    tokens = (TokenEvent(5, "Paris", "draft_accepted", 0, 0, 0.9, 0.8, "rest"), TokenEvent(6, ".", "bonus", 0, 1, 0.7, None))
    steps = (StepEvent(0, 4, 1, 1, 2, 0.01, 0.02, 2, 0.1),)
    store.update_message(mid, "Paris.", tokens, steps, meta="lookup", complete=True)
    other = store.create_conversation("Other")
    assert [c.id for c in store.conversations()] == [other, cid]

    reopened = HistoryStore()
    messages = reopened.messages(cid)
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].tokens == tokens and messages[1].steps == steps and messages[1].complete
    reopened.rename(cid, "France")
    assert reopened.title(cid) == "France"
    md = reopened.export_markdown(cid)
    assert md.startswith("# France") and "Capital of France?" in md and "Paris." in md
    exported = json.loads(reopened.export_json(cid))
    assert exported["messages"][1]["tokens"][0]["source"] == "draft_accepted"
    assert exported["messages"][1]["tokens"][0]["proposer"] == "rest"
    reopened.delete(cid)
    assert [c.id for c in reopened.conversations()] == [other]
    assert reopened.messages(cid) == []
    assert reopened._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_reloaded_conversation_keeps_colours_and_plots(qtbot, make_window):
    window = make_window(tiny_factory())
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, max_new_tokens=16))
    answer = send_and_wait(qtbot, window, "remember me")
    steps = window.plots.steps
    cid = window._conversation_id
    window.new_conversation()
    assert window.chat.messages == ()
    window.open_conversation(cid)
    assert window.chat.messages[1].tokens == answer.tokens
    assert window.plots.steps == steps
    doc = window.chat.document()
    cursor = QTextCursor(doc)
    sources = set()
    for position in range(1, doc.characterCount()):
        cursor.setPosition(position)
        sources.add(cursor.charFormat().property(SOURCE_PROPERTY))
    assert {t.source for t in answer.tokens} <= sources
    assert window.conversation_list.count() == 1
    assert window.conversation_list.currentItem().text() == "remember me"


CHILD = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {root!r})
    from PySide6.QtWidgets import QApplication
    app = QApplication([])
    from app.settings import AppSettings
    from app.window import MainWindow
    from tests.app_fixtures import tiny_factory
    window = MainWindow(engine_factory=tiny_factory(step_delay_s=0.05), preload=False,
                        settings=AppSettings(method="lookup", max_new_tokens=5000))
    window.show()
    window.send_message("please write a very long answer")
    app.exec()
    """
)


def test_sigkill_mid_answer_leaves_the_database_intact(app_dirs, tmp_path):
    _, data = app_dirs
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen")
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT)))
    child = subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT)
    db = data / "history.sqlite3"
    partial = ""
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not partial:
            time.sleep(0.3)
            assert child.poll() is None, "the app exited on its own"
            if not db.exists():
                continue
            try:
                with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as ro:
                    row = ro.execute("SELECT content FROM messages WHERE role = 'assistant'").fetchone()
            except sqlite3.OperationalError:
                continue
            partial = row[0] if row else ""
        assert partial, "no partial answer was saved"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert child.returncode == -signal.SIGKILL

    with sqlite3.connect(db) as check:
        assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    store = HistoryStore()
    (conversation,) = store.conversations()
    user, assistant = store.messages(conversation.id)
    assert (user.role, user.content, user.complete) == ("user", "please write a very long answer", True)
    assert assistant.role == "assistant" and not assistant.complete
    assert assistant.content.startswith(partial) and assistant.tokens
    assert "".join(t.text for t in assistant.tokens) == assistant.content


def test_messages_saved_before_tokens_had_a_proposer_still_load(app_dirs):
    store = HistoryStore()
    cid = store.create_conversation("Old")
    mid = store.add_message(cid, "assistant", "Hi", complete=True)
    old_row = json.dumps([[7, "Hi", "draft_accepted", 0, 0, 0.5, 0.4]])  # the seven fields of earlier versions
    store._db.execute("UPDATE messages SET tokens = ? WHERE id = ?", (old_row, mid))
    (message,) = HistoryStore().messages(cid)
    assert message.tokens == (TokenEvent(7, "Hi", "draft_accepted", 0, 0, 0.5, 0.4),)
    assert message.tokens[0].proposer is None
