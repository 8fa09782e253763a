"""Chat view and main window: streaming formats per source, Markdown with colours, multi-turn."""

from __future__ import annotations

from PySide6.QtGui import QTextCursor

from speclens.app.chat_view import SOURCE_PROPERTY, SOURCE_STYLES, ChatView, Message, token_tooltip
from speclens.app.settings import AppSettings
from speclens.engine.decoding.events import TokenEvent
from tests.app_fixtures import app_dirs, make_window, send_and_wait, tiny_factory  # noqa: F401 (fixtures)


def tok(text: str, source: str, step: int = 0, pos: int = 0) -> TokenEvent:
    p_draft = None if source in ("target", "bonus") else 0.5
    return TokenEvent(1, text, source, step, pos, 0.25, p_draft, "lookup" if source == "draft_accepted" else None)


def char_sources(view: ChatView, start: int, end: int) -> list[tuple[str, str | None]]:
    """(character, source property) for document positions [start, end)."""
    doc = view.document()
    out = []
    cursor = QTextCursor(doc)
    for position in range(start, end):
        cursor.setPosition(position + 1)  # charFormat() is the format of the character before
        fmt = cursor.charFormat()
        out.append((doc.characterAt(position), fmt.property(SOURCE_PROPERTY)))
    return out


def sources_of_text(view: ChatView, needle: str) -> set[str | None]:
    plain = view.document().toPlainText()
    start = plain.index(needle)
    return {source for _, source in char_sources(view, start, start + len(needle))}


def test_streamed_tokens_carry_their_source_format(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.add_message(Message("user", "hi"))
    view.begin_answer("test")
    tokens = [
        tok("Alpha", "draft_accepted"),
        tok(" beta", "target_resampled"),
        tok(" gamma", "bonus"),
        tok(" delta", "target"),
    ]
    view.append_tokens(tokens[:2])
    view.append_tokens(tokens[2:])
    end = view.document().characterCount() - 1
    text = "".join(t.text for t in tokens)
    start = end - len(text)
    got = char_sources(view, start, end)
    assert "".join(c for c, _ in got) == text
    expected = [t.source for t in tokens for _ in t.text]
    assert [s for _, s in got] == expected

    cursor = QTextCursor(view.document())
    for index, token in enumerate(tokens):
        offset = start + sum(len(t.text) for t in tokens[:index])
        cursor.setPosition(offset + 1)
        fmt = cursor.charFormat()
        colour = SOURCE_STYLES[token.source].background
        if colour:
            assert fmt.background().color().name() == colour
        else:
            assert fmt.background().style().name == "NoBrush"
        assert fmt.toolTip() == token_tooltip(token)
        assert f"step {token.step}" in fmt.toolTip()
        assert ("drafted by lookup" in fmt.toolTip()) == (token.source == "draft_accepted")


def test_finished_answer_renders_markdown_and_keeps_colours(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.add_message(Message("user", "show me"))
    view.begin_answer("")
    tokens = [
        tok("Here is", "target"),
        tok(" **bold**", "draft_accepted"),
        tok(" text.\n\n", "target"),
        tok("- first", "bonus"),
        tok("\n- second\n\n", "target_resampled"),
        tok("```python\n", "target"),
        tok("x = 1\n", "draft_accepted"),
        tok("```\n", "target"),
    ]
    view.append_tokens(tokens)
    text = "".join(t.text for t in tokens)
    view.finish_answer(Message("assistant", text, tuple(tokens)))
    plain = view.document().toPlainText()
    assert "**" not in plain and "```" not in plain and "- first" not in plain
    assert sources_of_text(view, "bold") == {"draft_accepted"}
    assert sources_of_text(view, "first") == {"bonus"}
    assert sources_of_text(view, "second") == {"target_resampled"}
    assert sources_of_text(view, "x = 1") == {"draft_accepted"}
    # bold survived as a font weight, and the list became a real list
    cursor = QTextCursor(view.document())
    cursor.setPosition(plain.index("bold") + 1)
    assert cursor.charFormat().fontWeight() > 500
    cursor.setPosition(plain.index("first"))
    assert cursor.block().textList() is not None


def test_hide_colours_removes_tints_but_keeps_sources(qtbot):
    view = ChatView()
    qtbot.addWidget(view)
    view.add_message(Message("user", "q"))
    tokens = (tok("green", "draft_accepted"), tok(" orange", "target_resampled"))
    view.add_message(Message("assistant", "green orange", tokens))
    plain = view.document().toPlainText()
    cursor = QTextCursor(view.document())
    cursor.setPosition(plain.index("green") + 1)
    assert cursor.charFormat().background().color().name() == SOURCE_STYLES["draft_accepted"].background
    view.set_colours(False)
    plain = view.document().toPlainText()
    cursor = QTextCursor(view.document())
    cursor.setPosition(plain.index("green") + 1)
    assert cursor.charFormat().background().style().name == "NoBrush"
    assert cursor.charFormat().property(SOURCE_PROPERTY) == "draft_accepted"


def test_window_streams_tiny_model_tokens_with_matching_formats(qtbot, make_window):
    window = make_window(tiny_factory(step_delay_s=0.02))
    window.apply_settings(AppSettings(method="draft", draft="tiny", k=3, max_new_tokens=40))
    assert window.send_message("The capital of France is")
    # mid-stream: the tail of the document is exactly the streamed tokens, each with its source
    qtbot.waitUntil(lambda: len(window.chat.live_tokens) >= 8, timeout=30_000)
    live = window.chat.live_tokens
    text = "".join(t.text for t in live)
    view = window.chat
    end = view.document().characterCount() - 1
    streamed = char_sources(view, end - len(text), end)
    # block separators read back as U+2029; compare sources only
    assert [s for _, s in streamed] == [t.source for t in live for _ in t.text]
    assert {t.source for t in live} <= {"draft_accepted", "target_resampled", "bonus"}
    with qtbot.waitSignal(window.answer_finished, timeout=60_000) as blocker:
        pass
    message = blocker.args[0]
    assert len(message.tokens) == 40
    assert message.text == "".join(t.text for t in message.tokens)
    assert "tok/s" in window.status_speed.text()


def test_multi_turn_sends_the_whole_conversation(qtbot, make_window):
    seen: list[list[dict]] = []

    def recording_factory(settings, progress):
        engine = tiny_factory()(settings, progress)
        original = engine.fit_chat

        def fit_chat(messages, max_new_tokens, policy="stop"):
            seen.append(list(messages))
            return original(messages, max_new_tokens, policy)

        engine.fit_chat = fit_chat
        return engine

    window = make_window(recording_factory)
    window.apply_settings(AppSettings(method="lookup", max_new_tokens=8))
    first = send_and_wait(qtbot, window, "first question")
    send_and_wait(qtbot, window, "second question")
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"]
    assert seen[1][0]["content"] == "first question"
    assert seen[1][1]["content"] == first.text
    assert seen[1][2]["content"] == "second question"
    roles = [m.role for m in window.chat.messages]
    assert roles == ["user", "assistant", "user", "assistant"]


def test_enter_sends_and_shift_enter_adds_a_newline(qtbot, make_window):
    from PySide6.QtCore import Qt

    window = make_window(tiny_factory())
    window.apply_settings(AppSettings(method="lookup", max_new_tokens=4))
    window.input.setFocus()
    qtbot.keyClicks(window.input, "line one")
    qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.input, "line two")
    assert window.input.toPlainText() == "line one\nline two"
    with qtbot.waitSignal(window.answer_finished, timeout=30_000):
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert window.input.toPlainText() == ""
    assert window.chat.messages[0].text == "line one\nline two"


def test_an_answer_names_the_method_that_ran_not_auto(qtbot, make_window):
    window = make_window(tiny_factory())
    assert window.settings.method == "auto"
    message = send_and_wait(qtbot, window, "one two three")
    ran = message.meta.split(" · ")[0].split(",")[0]
    assert ran != "auto" and ran in window._loaded.methods
