"""The window under bad input: a history it cannot write, damaged files moved aside, exports named from
hostile titles, write errors, a conversation past the model's context, bad settings values."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speclens.app import history as history_module
from speclens.app.history import MAX_FILE_STEM, HistoryStore, _check_writable, _move_aside, export_file_name
from speclens.app.settings import AppSettings, SettingsStore
from tests.app_fixtures import app_dirs, make_window, send_and_wait, tiny_factory  # noqa: F401 (fixtures)


def _history_with_one_chat(path: Path) -> None:
    store = HistoryStore(path)
    cid, _ = store.start_exchange(None, "an earlier chat", "hello there", "ar")
    store.close()


def test_the_writability_check_fails_on_a_read_only_database(tmp_path):
    path = tmp_path / "h.sqlite3"
    _history_with_one_chat(path)
    read_only = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)
    with pytest.raises(sqlite3.OperationalError, match="readonly"):
        _check_writable(read_only)
    _check_writable(sqlite3.connect(path))  # a writable one passes, and keeps nothing of the probe
    assert [c.title for c in HistoryStore(path).conversations()] == ["an earlier chat"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_a_read_only_history_file_is_refused_at_open(tmp_path):
    path = tmp_path / "h.sqlite3"
    _history_with_one_chat(path)
    path.chmod(0o444)
    with pytest.raises(sqlite3.Error):
        HistoryStore(path)


def test_a_history_that_cannot_be_written_falls_back_to_a_copy_in_memory(qtbot, make_window, app_dirs, monkeypatch):
    _, data = app_dirs
    data.mkdir(parents=True)
    path = data / "history.sqlite3"
    _history_with_one_chat(path)
    before = path.read_bytes()

    def read_only(db):  # what a read-only file gives (root, as tests may run, writes any file)
        raise sqlite3.OperationalError("attempt to write a readonly database")

    monkeypatch.setattr(history_module, "_check_writable", read_only)
    window = make_window(tiny_factory())
    banner = window.error_banner.text()
    assert window.history.path is None and "could not be opened for writing" in banner
    assert "earlier chats are shown from a copy" in banner and str(path) in banner
    assert [c.title for c in window.history.conversations()] == ["an earlier chat"]  # shown, not lost
    message = send_and_wait(qtbot, window, "one two three")
    assert message.text and not message.error  # Send works, in memory
    assert path.read_bytes() == before  # the file is never written


def test_files_moved_aside_in_the_same_second_never_overwrite_each_other(tmp_path):
    path = tmp_path / "history.sqlite3"
    kept = []
    for content in (b"first damaged file", b"second damaged file", b"third"):
        path.write_bytes(content)
        Path(f"{path}-wal").write_bytes(content + b" wal")
        kept.append(_move_aside(path))
    assert len(set(kept)) == 3
    assert [k.read_bytes() for k in kept] == [b"first damaged file", b"second damaged file", b"third"]
    assert [Path(f"{k}-wal").read_bytes() for k in kept] == [b"first damaged file wal", b"second damaged file wal",
                                                             b"third wal"]


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=300))
def test_export_names_are_plain_file_names_whatever_the_title(title):
    name = export_file_name(title, "md")
    stem = name.removesuffix(".md")
    assert name.endswith(".md") and stem and len(stem) <= MAX_FILE_STEM
    assert not any(ch in name for ch in "/\\\0") and all(ch.isprintable() for ch in name)
    assert not name.startswith((".", " ")) and Path(name).name == name and name not in (".md", "..md")


def test_hostile_titles_give_names_inside_the_folder():
    assert export_file_name("../../etc/passwd", "md") == "etc passwd.md"
    assert export_file_name("/abs/path", "json") == "abs path.json"
    assert export_file_name("a\0b\nc", "md") == "a b c.md"
    assert export_file_name("...", "md") == "chat.md"
    assert export_file_name("Recipe: bread?", "json") == "Recipe bread.json"


def test_export_suggests_a_safe_name_in_the_documents_folder_and_errors_become_a_banner(
        qtbot, make_window, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog

    window = make_window(tiny_factory())
    send_and_wait(qtbot, window, "one two")
    cid = window._conversation_id
    window.history.rename(cid, "../../outside/\0secret")
    offered = []

    def fake_dialog(parent, caption, default, filters):
        offered.append(default)
        return "", ""

    monkeypatch.setattr(QFileDialog, "getSaveFileName", fake_dialog)
    window._export(cid, "md")
    suggested = Path(offered[0])
    assert suggested.name == "outside secret.md" and ".." not in suggested.parts
    assert not window.export_to(cid, "md", tmp_path / "no-such-folder" / "x.md")  # a write error
    assert window.error_banner.isVisible() and "Could not export the chat" in window.error_banner.text()
    assert window.export_to(cid, "json", tmp_path / "chat.json") and (tmp_path / "chat.json").is_file()
    window._export(cid, "md")
    assert Path(offered[1]).parent == tmp_path  # the last export folder next time


def small_context(tokens: int):
    """A tiny-engine factory whose target's context holds `tokens`."""
    def factory(settings, progress):
        engine = tiny_factory()(settings, progress)
        engine.target_lm.context_length = tokens
        return engine

    return factory


def test_a_long_conversation_drops_its_oldest_turns_and_says_so(qtbot, make_window, tmp_path):
    window = make_window(small_context(160), settings=AppSettings(method="lookup", max_new_tokens=24,
                                                             system_prompt="You are terse."))
    first = send_and_wait(qtbot, window, "one two three four five six seven eight nine ten " * 3)
    assert not window.notice_banner.isVisible() and "/ 160" in window.status_context.text()
    second = send_and_wait(qtbot, window, "two three four five six seven eight nine ten eleven " * 3)
    third = send_and_wait(qtbot, window, "three four five six seven eight nine ten eleven twelve " * 3)
    assert first.text and second.text and third.text and not third.error
    assert window.notice_banner.isVisible() and "oldest turn" in window.notice_banner.text()
    used, total = window.status_context.text().removeprefix("context ").split(" / ")
    assert int(total) == 160 and int(used.replace(",", "")) <= 160
    assert len(window.history.messages(window._conversation_id)) == 6  # nothing dropped from the history
    window.grab().save(str(tmp_path / "overflow.png"))
    if os.environ.get("SPECLENS_SCREENSHOT_DIR"):
        window.grab().save(os.path.join(os.environ["SPECLENS_SCREENSHOT_DIR"], "overflow.png"))


def test_the_stop_policy_says_why_and_keeps_the_question(qtbot, make_window):
    window = make_window(small_context(40), settings=AppSettings(method="lookup", max_new_tokens=8,
                                                             context_overflow="stop"))
    message = send_and_wait(qtbot, window, "one two three four five six seven eight nine ten " * 4)
    assert message.error and "context holds 40" in message.error and window.error_banner.isVisible()
    stored = window.history.messages(window._conversation_id)
    assert stored[0].content.startswith("one two three")  # the question is kept


@pytest.mark.parametrize("line, setting", [
    ("temperature = nan", "temperature"), ("temperature = inf", "temperature"), ("top_p = -0.5", "top_p"),
    ("k = 4.5", "k"), ("k = true", "k"), ("max_new_tokens = 100000", "max_new_tokens"),
    ("context_overflow = 'truncate'", "context_overflow"), ("method = 'warp'", "method"),
    ("device = 'gpu'", "device"), ("seed = -7", "seed"),
])
def test_a_bad_value_in_settings_toml_keeps_its_default_and_says_which(tmp_path, line, setting):
    path = tmp_path / "settings.toml"
    path.write_text(f"{line}\ntop_k = 7\n")
    store = SettingsStore(path)
    loaded = store.load()
    assert getattr(loaded, setting) == getattr(AppSettings(), setting) and loaded.top_k == 7
    assert any(p.startswith(f"{setting} = ") for p in store.problems), store.problems


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
def test_ctrl_c_closes_the_window_and_exits_130(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from tests.tiny import tiny_llama, tiny_tokenizer

    folder = tmp_path / "model"
    tiny_llama(seed=0).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "SPECLENS_CONFIG_DIR": str(tmp_path / "config"),
           "SPECLENS_DATA_DIR": str(tmp_path / "data")}
    proc = subprocess.Popen([sys.executable, "-m", "speclens.app", "--target", str(folder)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60  # the window up: it writes its history file at start
    while not (tmp_path / "data" / "history.sqlite3").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"interrupted" in err and b"Traceback" not in err


def test_drafter_folders_that_fit_are_offered_and_the_others_left_out_with_why(qtbot, make_window, tmp_path):
    """Settings > Drafter folders: an EAGLE-3 folder for this target adds its methods; a DFlash folder
    made for a wider model is left out, said in a banner and in the Compatibility report."""
    from speclens.engine.session import Engine
    from tests.test_dflash import write_zlab_checkpoint
    from tests.test_eagle3 import write_specforge_checkpoint
    from tests.tiny import loaded, tiny_llama

    write_specforge_checkpoint(tmp_path / "eagle3", tiny_llama(0), layers=(0, 1, 2))
    write_zlab_checkpoint(tmp_path / "dflash-wide", tiny_llama(0, layers=4), hidden=32, layer_ids=(0, 1))
    seen = []

    def factory(settings, progress):
        seen.append(settings)
        return Engine(loaded(tiny_llama(0), "tiny-target"), None, settings.heads, None, settings.skip_unfit)

    chosen = AppSettings(target="tiny", method="eagle3_chain", max_new_tokens=8,
                         drafter_folders=f"{tmp_path / 'eagle3'}\n{tmp_path / 'dflash-wide'}\n")
    window = make_window(factory, settings=chosen)
    send_and_wait(qtbot, window, "one two three")
    assert seen[0].heads == (str(tmp_path / "eagle3"), str(tmp_path / "dflash-wide")) and seen[0].skip_unfit
    assert {"eagle3", "eagle3_chain"} <= set(window._loaded.methods) and "dflash" not in window._loaded.methods
    assert window.history.messages(window._conversation_id)[-1].role == "assistant"  # answered with eagle3_chain
    assert not window.notice_banner.isHidden()
    banner = window.notice_banner.text()
    assert "Left out 1 drafter folder" in banner and "dflash-wide (DFlash)" in banner and "width 32" in banner
    lines = window._loaded.drafters
    assert lines[0].startswith("✓ eagle3 (EAGLE-3): fits") and lines[1].startswith("✗ dflash-wide (DFlash)")
