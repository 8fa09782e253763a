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

from speclens.app.chat_view import SOURCE_PROPERTY
from speclens.app.history import HistoryStore
from speclens.app.settings import AppSettings
from speclens.engine.decoding.events import StepEvent, TokenEvent
from tests.app_fixtures import app_dirs, make_window, record_requests, send_and_wait, tiny_factory  # noqa: F401 (fixtures)

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
    from speclens.app.settings import AppSettings
    from speclens.app.window import MainWindow
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


def test_an_unreadable_history_is_moved_aside_and_a_new_one_started(qtbot, make_window, app_dirs):
    _, data = app_dirs
    data.mkdir(parents=True)
    (data / "history.sqlite3").write_bytes(b"not a database at all, " * 200)
    window = make_window(tiny_factory())
    (kept,) = data.glob("history.sqlite3.unreadable-*")
    assert kept.read_bytes().startswith(b"not a database at all")  # nothing deleted
    assert window.error_banner.isVisible() and str(kept) in window.error_banner.text()
    message = send_and_wait(qtbot, window, "one two three")
    assert message.text and not message.error
    (conversation,) = HistoryStore().conversations()  # the new file works


def test_a_history_that_cannot_be_opened_keeps_this_session_in_memory(qtbot, make_window, app_dirs):
    _, data = app_dirs
    (data / "history.sqlite3").mkdir(parents=True)  # sqlite cannot open a folder: OperationalError
    window = make_window(tiny_factory())
    assert window.history.path is None and "kept only until SpecLens closes" in window.error_banner.text()
    message = send_and_wait(qtbot, window, "one two three")
    assert message.text and len(window.history.messages(window._conversation_id)) == 2
    assert (data / "history.sqlite3").is_dir()  # left as it was


def test_a_locked_history_loses_nothing_and_never_leaves_the_window_busy(qtbot, make_window):
    window = make_window(tiny_factory(step_delay_s=0.02),
                         settings=AppSettings(method="draft", draft="tiny", k=3, max_new_tokens=24, adaptive_k=False))
    send_and_wait(qtbot, window, "first question")
    locker = sqlite3.connect(window.history.path, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # another program holds the write lock
    try:
        assert not window.send_message("typed while locked")  # refused: it could not be saved
        assert "Nothing was sent" in window.error_banner.text() and not window.busy
        assert "typed while locked" not in window.chat.toPlainText()
        window.error_banner.hide()
        locker.execute("COMMIT")
        with qtbot.waitSignal(window.answer_finished, timeout=60_000) as finished:
            assert window.send_message("second question")
            locker.execute("BEGIN IMMEDIATE")  # taken while the answer streams, held past its end
        answer = finished.args[0]
        assert not window.busy and window.send_button.isEnabled() and not window.stop_button.isEnabled()
        assert "Could not save the answer" in window.error_banner.text()
        assert answer.text and window.chat.messages[-1] == answer  # on screen
        assert "generating…" not in window.chat.toPlainText()
    finally:
        locker.execute("COMMIT")
        locker.close()
    stored = [m.role for m in window.history.messages(window._conversation_id)]
    assert stored == ["user", "assistant", "user", "assistant"]  # the refused message left no trace


def test_a_question_whose_answer_failed_is_not_sent_again():
    from speclens.app.chat_view import Message
    from speclens.app.window import model_context

    messages = [Message("user", "first"), Message("assistant", "", error="Could not load the model: gone"),
                Message("user", "second"), Message("assistant", "an answer"),
                Message("user", "third"), Message("assistant", "half an ans", error="(stopped)"),
                Message("user", "fourth")]
    assert model_context(messages) == (("user", "second"), ("assistant", "an answer"), ("user", "third"),
                                       ("assistant", "half an ans"), ("user", "fourth"))


def test_restart_answer_replaces_only_a_trailing_answer(app_dirs):
    store = HistoryStore()
    cid, first = store.start_exchange(None, "t", "question", "meta 1")
    store.update_message(first, "old answer", [], [], complete=True)
    store.restart_answer(cid, "meta 2")
    assert [(m.role, m.content, m.meta, m.complete) for m in store.messages(cid)] == [
        ("user", "question", "", True), ("assistant", "", "meta 2", False)]
    store.add_message(cid, "user", "a question with no answer yet")
    third = store.restart_answer(cid, "meta 3")  # nothing to replace: the user's turn stays
    assert [(m.id, m.role) for m in store.messages(cid)][-2:] == [(third - 1, "user"), (third, "assistant")]
    assert len(store.messages(cid)) == 4


def _action(menu, text: str):
    return next((a for a in menu.actions() if a.text() == text), None)


def test_regenerate_replaces_the_last_answer_on_screen_and_in_the_history(qtbot, make_window):
    from PySide6.QtGui import QGuiApplication

    from speclens.app.chat_view import ChatView

    window = make_window(tiny_factory(), settings=AppSettings(method="ar", temperature=0.0, max_new_tokens=8))
    assert not window.regenerate()  # nothing to answer again yet
    first = send_and_wait(qtbot, window, "one two")
    second = send_and_wait(qtbot, window, "three four")
    starts = window.chat._starts
    over_first, over_last = window.chat.menu_at(starts[1] + 1), window.chat.menu_at(starts[3] + 1)
    assert _action(over_first, "Regenerate this answer") is None  # only the last answer
    _action(over_first, "Copy this answer").trigger()
    assert QGuiApplication.clipboard().text() == first.text
    assert _action(over_last, "Regenerate this answer").isEnabled()
    assert _action(window.chat.menu_at(starts[2] + 1), "Copy this answer") is None  # a question

    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, temperature=0.0, max_new_tokens=12),
                          persist=False)
    sent = record_requests(window)
    with qtbot.waitSignal(window.answer_finished, timeout=60_000) as finished:
        _action(over_last, "Regenerate this answer").trigger()
        assert window.busy and not window.chat.can_regenerate
        assert not window.regenerate()  # refused while the new answer is generated
    new = finished.args[0]
    assert sent[0].messages == (("user", "one two"), ("assistant", first.text), ("user", "three four"))
    assert new.meta.startswith("draft") and new.text.startswith(second.text)  # greedy: the same text, longer
    assert [m.role for m in window.chat.messages] == ["user", "assistant", "user", "assistant"]
    assert window.chat.messages[-1] == new and window.chat.can_regenerate
    rendered = ChatView()  # the transcript left after removing the old answer renders as if built anew
    rendered.set_messages(window.chat.messages)
    assert window.chat.toPlainText() == rendered.toPlainText()
    stored = window.history.messages(window._conversation_id)
    assert [(m.role, m.content) for m in stored] == [("user", "one two"), ("assistant", first.text),
                                                      ("user", "three four"), ("assistant", new.text)]
    assert stored[-1].complete and stored[-1].meta == new.meta and len(stored[-1].tokens) == len(new.tokens)
    assert window.plots.steps  # the plots show the new answer's steps
