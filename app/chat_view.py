"""The conversation view: tokens coloured by provenance, a tooltip per token, Markdown when done.

While an answer streams, each token is inserted as plain text with its source's QTextCharFormat.
When it finishes, the answer is rendered as Markdown by Qt (md4c) into a scratch document, and the
formats are put back by aligning the answer's source text with the rendered plain text (the
characters Markdown consumes, such as ``**`` or fences, simply have no owner).
"""

from __future__ import annotations

import bisect
import difflib
import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QGuiApplication,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextDocumentFragment,
    QTextFormat,
)
from PySide6.QtWidgets import QHBoxLayout, QLabel, QMenu, QTextBrowser, QToolTip, QWidget

from speclens.engine.decoding.events import SOURCES, TokenEvent

SOURCE_PROPERTY = QTextFormat.Property.UserProperty + 1  # the token's source, for tests and tools


@dataclass(frozen=True)
class SourceStyle:
    label: str
    background: str  # empty: no tint
    description: str


SOURCE_STYLES: dict[str, SourceStyle] = {
    "draft_accepted": SourceStyle("Accepted draft", "#bfe8c4", "proposed by the drafter and accepted by the target"),
    "target_resampled": SourceStyle("Corrected", "#ffc9a8", "drafted token rejected; the target resampled this one"),
    "bonus": SourceStyle("Bonus", "#d6cbff", "all drafts accepted; the target's free extra token"),
    "target": SourceStyle("Target", "", "plain decoding by the target (nothing drafted here)"),
}
TINT_TEXT = "#1b1b1b"  # tints are light, so tinted text stays dark in any theme


def source_format(source: str, colours: bool = True) -> QTextCharFormat:
    fmt = QTextCharFormat()
    fmt.setProperty(SOURCE_PROPERTY, source)
    style = SOURCE_STYLES[source]
    if colours and style.background:
        fmt.setBackground(QBrush(QColor(style.background)))
        fmt.setForeground(QBrush(QColor(TINT_TEXT)))
    else:
        fmt.clearBackground()
        fmt.clearForeground()
    return fmt


def token_tooltip(token: TokenEvent) -> str:
    def num(value: float | None) -> str:
        return "—" if value is None else f"{value:.3f}"

    proposer = f", drafted by {token.proposer}" if token.proposer else ""
    return (
        f"{SOURCE_STYLES[token.source].label} ({token.source}{proposer})\n"
        f"step {token.step}, position {token.pos}\n"
        f"p_target {num(token.p_target)}   p_draft {num(token.p_draft)}\n"
        f"accept probability {num(token.accept_prob)}"
    )


def token_format(token: TokenEvent, colours: bool = True) -> QTextCharFormat:
    fmt = source_format(token.source, colours)
    fmt.setToolTip(token_tooltip(token))
    return fmt


@dataclass(frozen=True)
class Message:
    """One finished turn as the view shows it (and history stores it)."""

    role: str  # "user" or "assistant"
    text: str
    tokens: tuple[TokenEvent, ...] = ()
    meta: str = ""  # one line shown under the assistant header (model, method, speed)
    error: str = ""


def colour_document(
    doc: QTextDocument, source_text: str, tokens: Sequence[TokenEvent], colours: bool
) -> None:
    """Merge each token's format onto the characters of `doc` that came from it."""
    owner: list[int] = []
    for index, token in enumerate(tokens):
        owner.extend([index] * len(token.text))
    plain = doc.toPlainText()
    doc_owner = [-1] * len(plain)
    matcher = difflib.SequenceMatcher(None, source_text, plain, autojunk=False)
    for a, b, size in matcher.get_matching_blocks():
        doc_owner[b : b + size] = owner[a : a + size]
    cursor = QTextCursor(doc)
    start = 0
    for end in range(1, len(plain) + 1):
        if end < len(plain) and doc_owner[end] == doc_owner[start]:
            continue
        if doc_owner[start] >= 0:
            cursor.setPosition(start)
            cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
            cursor.mergeCharFormat(token_format(tokens[doc_owner[start]], colours))
        start = end


def markdown_document(tokens: Sequence[TokenEvent], colours: bool, text: str | None = None) -> QTextDocument:
    source = "".join(t.text for t in tokens) if text is None else text
    doc = QTextDocument()
    doc.setMarkdown(source, QTextDocument.MarkdownFeature.MarkdownDialectGitHub)
    _style_code_blocks(doc)
    if tokens:
        colour_document(doc, source, tokens, colours)
    return doc


def _style_code_blocks(doc: QTextDocument) -> None:
    block = doc.begin()
    while block.isValid():
        fmt = block.blockFormat()
        if fmt.hasProperty(QTextFormat.Property.BlockCodeFence) or fmt.nonBreakableLines():
            fmt.setBackground(QColor("#f3f4f6"))
            fmt.setLeftMargin(8)
            cursor = QTextCursor(block)
            cursor.setBlockFormat(fmt)
        block = block.next()


class ChatView(QTextBrowser):
    """Read-only transcript. `answer_selected(index)` fires when an assistant message is clicked;
    `regenerate_requested` when the user asks for the last answer again (its context menu)."""

    answer_selected = Signal(int)
    regenerate_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.document().setDocumentMargin(14)
        self._messages: list[Message] = []
        self._starts: list[int] = []  # document position where each message section begins
        self._live: list[TokenEvent] | None = None
        self._live_header = ""
        self._live_start = 0
        self._colours = True

    # -- content ---------------------------------------------------------------------------------

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(self._messages)

    @property
    def live_tokens(self) -> tuple[TokenEvent, ...]:
        return tuple(self._live or ())

    @property
    def can_regenerate(self) -> bool:
        """No answer is streaming: the last message is a finished one."""
        return self._live is None

    def set_messages(self, messages: Iterable[Message]) -> None:
        self._messages = list(messages)
        self._live = None
        self._rerender()

    def add_message(self, message: Message) -> None:
        self._messages.append(message)
        self._write_message(len(self._messages) - 1, message)
        self._scroll_to_end()

    def begin_answer(self, header: str) -> None:
        self._live = []
        self._live_header = header
        self._starts.append(self._end())
        self._write_live_header()

    def append_tokens(self, tokens: Sequence[TokenEvent]) -> None:
        if self._live is None or not tokens:
            return
        self._live.extend(tokens)
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.beginEditBlock()
        for token in tokens:
            cursor.insertText(token.text, token_format(token, self._colours))
        cursor.endEditBlock()
        self._scroll_to_end()

    def finish_answer(self, message: Message) -> None:
        """Replace the streamed text with the rendered message (Markdown, colours kept)."""
        if self._live is None:
            self.add_message(message)
            return
        self._live = None
        self._remove_last_section()
        self._messages.append(message)
        self._write_message(len(self._messages) - 1, message)
        self._scroll_to_end()

    def remove_last(self) -> Message:
        """Take the last message off the transcript (an answer about to be regenerated)."""
        self._remove_last_section()
        return self._messages.pop()

    def _remove_last_section(self) -> None:
        """Delete the document from where the last message (or the streaming answer) begins."""
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._starts.pop())
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()

    def set_colours(self, on: bool) -> None:
        if on != self._colours:
            self._colours = on
            self._rerender()

    @property
    def colours(self) -> bool:
        return self._colours

    def message_index_at(self, position: int) -> int:
        return bisect.bisect_right(self._starts, position) - 1

    # -- rendering -------------------------------------------------------------------------------

    def _rerender(self) -> None:
        live = self._live
        self.clear()
        self._starts = []
        for index, message in enumerate(self._messages):
            self._write_message(index, message)
        if live is not None:
            self._live = []
            self._starts.append(self._end())
            self._write_live_header()
            self.append_tokens(live)
        self._scroll_to_end()

    def _end(self) -> int:
        return max(0, self.document().characterCount() - 1)

    def _new_block(self, cursor: QTextCursor, block: QTextBlockFormat | None = None) -> None:
        if self.document().isEmpty():
            cursor.setBlockFormat(block or QTextBlockFormat())
            cursor.setCharFormat(QTextCharFormat())
        else:
            cursor.insertBlock(block or QTextBlockFormat(), QTextCharFormat())

    def _write_header(self, cursor: QTextCursor, title: str, meta: str) -> None:
        block = QTextBlockFormat()
        block.setTopMargin(14)
        block.setBottomMargin(4)
        self._new_block(cursor, block)
        bold = QTextCharFormat()
        bold.setFontWeight(QFont.Weight.DemiBold)
        cursor.insertText(title, bold)
        if meta:
            grey = QTextCharFormat()
            grey.setForeground(QColor("#6b7280"))
            cursor.insertText(f"   {meta}", grey)

    def _write_live_header(self) -> None:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        self._write_header(cursor, "Assistant", self._live_header)
        self._new_block(cursor)

    def _write_message(self, index: int, message: Message) -> None:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if len(self._starts) <= index:
            self._starts.append(self._end())
        if message.role == "user":
            self._write_header(cursor, "You", "")
            block = QTextBlockFormat()
            block.setBackground(QColor("#eef2f7"))
            block.setLeftMargin(0)
            block.setBottomMargin(2)
            for line in message.text.split("\n"):
                cursor.insertBlock(block, QTextCharFormat())
                cursor.insertText(line)
            return
        self._write_header(cursor, "Assistant", message.meta)
        self._new_block(cursor)
        if message.text or message.tokens:
            doc = markdown_document(message.tokens, self._colours, message.text if not message.tokens else None)
            cursor.insertFragment(QTextDocumentFragment(doc))
        if message.error:
            red = QTextCharFormat()
            red.setForeground(QColor("#b00020"))
            red.setFontItalic(True)
            if message.text or message.tokens:
                cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            cursor.insertText(message.error, red)

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    # -- interaction -----------------------------------------------------------------------------

    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            cursor = self.cursorForPosition(event.pos())
            cursor.movePosition(QTextCursor.MoveOperation.NextCharacter)
            tip = cursor.charFormat().toolTip()
            if tip:
                QToolTip.showText(event.globalPos(), tip, self.viewport())
            else:
                QToolTip.hideText()
            return True
        return super().viewportEvent(event)

    def menu_at(self, position: int) -> QMenu:
        """The context menu at document `position`: the standard copy actions, then, over an answer,
        copying that whole answer and (the last one, when idle) regenerating it."""
        menu = self.createStandardContextMenu()
        menu.setToolTipsVisible(True)
        index = self.message_index_at(position)
        if 0 <= index < len(self._messages) and self._messages[index].role == "assistant" and self.can_regenerate:
            menu.addSeparator()
            text = self._messages[index].text
            copy = menu.addAction("Copy this answer", lambda: QGuiApplication.clipboard().setText(text))
            copy.setEnabled(bool(text))
            if index == len(self._messages) - 1:
                again = menu.addAction("Regenerate this answer", self.regenerate_requested.emit)
                again.setToolTip("Answer the question again with the current settings; this answer is replaced")
        return menu

    def contextMenuEvent(self, event) -> None:
        menu = self.menu_at(self.cursorForPosition(event.pos()).position())
        menu.exec(event.globalPos())
        menu.deleteLater()

    def mouseReleaseEvent(self, event) -> None:
        super().mouseReleaseEvent(event)
        if event.button() == Qt.MouseButton.LeftButton and not self.textCursor().hasSelection():
            index = self.message_index_at(self.cursorForPosition(event.position().toPoint()).position())
            if 0 <= index < len(self._messages) and self._messages[index].role == "assistant":
                self.answer_selected.emit(index)


class Legend(QWidget):
    """The four sources with their colours; the tooltip explains each."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.setSpacing(6)
        for source in SOURCES:
            style = SOURCE_STYLES[source]
            chip = QLabel(html.escape(style.label))
            background = style.background or "transparent"
            chip.setStyleSheet(
                f"QLabel {{ background: {background}; color: {TINT_TEXT if style.background else 'palette(text)'};"
                " border: 1px solid #c9ced6; border-radius: 4px; padding: 2px 8px; }"
            )
            chip.setToolTip(style.description)
            row.addWidget(chip)
        row.addStretch(1)
