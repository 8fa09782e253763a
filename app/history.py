"""Conversations in SQLite (WAL), with token sources and step events so reloads keep colours.

Every write is its own short transaction, so a killed app loses at most the partial answer written
since the last save.
"""

from __future__ import annotations

import itertools
import json
import os
import sqlite3
import time
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

import platformdirs

from speclens.engine.decoding.events import StepEvent, TokenEvent

SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
    role TEXT NOT NULL,
    content TEXT NOT NULL,
    tokens TEXT NOT NULL DEFAULT '[]',
    steps TEXT NOT NULL DEFAULT '[]',
    meta TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    complete INTEGER NOT NULL DEFAULT 1,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_by_conversation ON messages(conversation_id, id);
"""

_TOKEN_FIELDS = tuple(TokenEvent.__dataclass_fields__)  # older rows lack the trailing fields; defaults fill them
_STEP_FIELDS = tuple(StepEvent.__dataclass_fields__)


def data_dir() -> Path:
    override = os.environ.get("SPECLENS_DATA_DIR")
    return Path(override) if override else Path(platformdirs.user_data_dir("speclens"))


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    updated: float


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    tokens: tuple[TokenEvent, ...]
    steps: tuple[StepEvent, ...]
    meta: str
    error: str
    complete: bool


def _tokens_json(tokens: tuple[TokenEvent, ...] | list[TokenEvent]) -> str:
    return json.dumps([[getattr(t, f) for f in _TOKEN_FIELDS] for t in tokens], separators=(",", ":"))


def _steps_json(steps: tuple[StepEvent, ...] | list[StepEvent]) -> str:
    return json.dumps([[getattr(s, f) for f in _STEP_FIELDS] for s in steps], separators=(",", ":"))


# Writes run on the GUI thread: when another program holds the file's lock (a database browser), a
# write gives up after this long and the window says so, rather than freezing for sqlite's default 5 s.
LOCK_TIMEOUT_S = 1.0


def _open(target: Path | str) -> sqlite3.Connection:
    """A connection to a checked history database; sqlite3.DatabaseError (not OperationalError) when the
    file is not one or is damaged."""
    db = sqlite3.connect(target, isolation_level=None, timeout=LOCK_TIMEOUT_S)  # autocommit; explicit txns
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        (check,) = db.execute("PRAGMA quick_check").fetchone()
        if check != "ok":
            raise sqlite3.DatabaseError(f"damaged database: {check}")
        db.executescript(SCHEMA)
    except BaseException:
        db.close()
        raise
    return db


DB_PARTS = ("", "-wal", "-shm")  # a WAL database's files: path + each suffix


def default_history_path() -> Path:
    return data_dir() / "history.sqlite3"


def _move_aside(path: Path) -> Path:
    """Rename an unreadable database (and its WAL files) out of the way, keeping it for recovery. The new
    name is one no file has (a counter follows the time when needed): nothing kept is overwritten."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count(1):
        target = path.with_name(f"{path.name}.unreadable-{stamp}" + (f"-{n}" if n > 1 else ""))
        if not any(Path(f"{target}{suffix}").exists() for suffix in DB_PARTS):
            break
    for suffix in DB_PARTS:
        part = Path(f"{path}{suffix}")
        if part.exists():
            part.rename(f"{target}{suffix}")
    return target


def _check_writable(db: sqlite3.Connection) -> None:
    """sqlite3.OperationalError when nothing can be written (a read-only file opens and reads fine, and
    would only fail at the first Send): a write that is rolled back."""
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute("INSERT INTO conversations (title, created, updated) VALUES ('', 0, 0)")
    finally:
        db.execute("ROLLBACK")


MAX_FILE_STEM = 80  # characters of an exported file's suggested name


def export_file_name(title: str, suffix: str) -> str:
    """A file name made from a conversation's title, safe to offer in a save dialog: no path separators,
    NUL or other control characters, no leading dots or spaces (no hidden file, no `..`), at most
    MAX_FILE_STEM characters before `.suffix`; "chat" when nothing is left."""
    stem = "".join(" " if ch in '/\\:*?"<>|' or unicodedata.category(ch)[0] == "C" else ch for ch in title)
    stem = " ".join(stem.split()).lstrip(". ").rstrip(". ")[:MAX_FILE_STEM].rstrip(". ")
    return f"{stem or 'chat'}.{suffix}"


class HistoryStore:
    """Used from the GUI thread only (sqlite connections are not shared across threads).

    A file that is not a database, or a damaged one, is moved aside (`moved_aside`) and a new history
    started; a locked or unwritable one raises sqlite3.OperationalError (the window then keeps this
    session's chats in memory, `HistoryStore.in_memory`)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path: Path | None = path or default_history_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.moved_aside: Path | None = None
        try:
            self._db = _open(self.path)
        except sqlite3.OperationalError:  # locked, read-only, ...: the file may be fine, so leave it be
            raise
        except sqlite3.DatabaseError:
            self.moved_aside = _move_aside(self.path)
            self._db = _open(self.path)
        try:
            _check_writable(self._db)
        except sqlite3.Error:
            self._db.close()
            raise

    @classmethod
    def in_memory(cls, copy_of: Path | None = None) -> HistoryStore:
        """A history for this session only (path None), for when the file cannot be opened or written;
        with `copy_of`, it starts as a copy of that file where it can still be read, so the earlier chats
        stay on screen (the file itself is never written)."""
        store = cls.__new__(cls)
        store.path, store.moved_aside = None, None
        store._db = _open(":memory:")
        try:
            if copy_of is not None and copy_of.exists():
                source = sqlite3.connect(f"{copy_of.resolve().as_uri()}?mode=ro", uri=True, timeout=LOCK_TIMEOUT_S)
                try:
                    source.backup(store._db)
                finally:
                    source.close()
                (check,) = store._db.execute("PRAGMA quick_check").fetchone()
                if check != "ok":
                    raise sqlite3.DatabaseError(check)
                store._db.executescript(SCHEMA)
                store.conversations()  # readable as a history, or not used
        except (OSError, sqlite3.Error):  # not even readable: an empty history
            store._db.close()
            store._db = _open(":memory:")
        return store

    def close(self) -> None:
        self._db.close()

    # -- conversations ---------------------------------------------------------------------------

    def conversations(self) -> list[Conversation]:
        rows = self._db.execute(
            "SELECT id, title, updated FROM conversations ORDER BY updated DESC, id DESC"
        )
        return [Conversation(*row) for row in rows]

    def create_conversation(self, title: str = "New chat") -> int:
        return self._insert_conversation(title, time.time())

    def _insert_conversation(self, title: str, now: float) -> int:
        return int(self._db.execute(
            "INSERT INTO conversations (title, created, updated) VALUES (?, ?, ?)", (title, now, now)
        ).lastrowid)

    def rename(self, conversation_id: int, title: str) -> None:
        self._db.execute("UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id))

    def delete(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def title(self, conversation_id: int) -> str:
        row = self._db.execute(
            "SELECT title FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return row[0] if row else ""

    # -- messages --------------------------------------------------------------------------------

    def start_exchange(self, conversation_id: int | None, title: str, user_text: str, meta: str) -> tuple[int, int]:
        """In one transaction, all or nothing: the conversation (a new one titled `title` when
        conversation_id is None), the user's message and the assistant's empty, incomplete answer.
        Returns (conversation id, the answer's message id)."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            if conversation_id is None:
                conversation_id = self._insert_conversation(title, now)
            self._insert_message(conversation_id, "user", user_text, "", True, now)
            answer = self._insert_message(conversation_id, "assistant", "", meta, False, now)
        return conversation_id, answer

    def restart_answer(self, conversation_id: int, meta: str) -> int:
        """In one transaction: delete the conversation's last message if it is an answer, and add an
        empty, incomplete answer in its place (to regenerate it). Returns the new answer's id."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            last = self._db.execute(
                "SELECT id, role FROM messages WHERE conversation_id = ? ORDER BY id DESC LIMIT 1", (conversation_id,)
            ).fetchone()
            if last is not None and last[1] == "assistant":
                self._db.execute("DELETE FROM messages WHERE id = ?", (last[0],))
            return self._insert_message(conversation_id, "assistant", "", meta, False, now)

    def add_message(
        self, conversation_id: int, role: str, content: str, *, complete: bool = True, meta: str = ""
    ) -> int:
        with self._db:
            self._db.execute("BEGIN")
            return self._insert_message(conversation_id, role, content, meta, complete, time.time())

    def _insert_message(self, conversation_id: int, role: str, content: str, meta: str, complete: bool,
                        now: float) -> int:
        """Within the caller's transaction: the message, and the conversation's `updated` time."""
        message_id = self._db.execute(
            "INSERT INTO messages (conversation_id, role, content, meta, complete, created)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (conversation_id, role, content, meta, int(complete), now),
        ).lastrowid
        self._db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return int(message_id)

    def update_message(
        self,
        message_id: int,
        content: str,
        tokens: tuple[TokenEvent, ...] | list[TokenEvent] = (),
        steps: tuple[StepEvent, ...] | list[StepEvent] = (),
        *,
        meta: str | None = None,
        error: str = "",
        complete: bool = False,
    ) -> None:
        self._db.execute(
            "UPDATE messages SET content = ?, tokens = ?, steps = ?, meta = COALESCE(?, meta),"
            " error = ?, complete = ? WHERE id = ?",
            (content, _tokens_json(tokens), _steps_json(steps), meta, error, int(complete), message_id),
        )

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        rows = self._db.execute(
            "SELECT id, role, content, tokens, steps, meta, error, complete FROM messages"
            " WHERE conversation_id = ? ORDER BY id",
            (conversation_id,),
        )
        return [
            StoredMessage(
                id=mid,
                role=role,
                content=content,
                tokens=tuple(TokenEvent(*t[: len(_TOKEN_FIELDS)]) for t in json.loads(tokens)),
                steps=tuple(StepEvent(*s) for s in json.loads(steps)),
                meta=meta,
                error=error,
                complete=bool(complete),
            )
            for mid, role, content, tokens, steps, meta, error, complete in rows
        ]

    # -- export ----------------------------------------------------------------------------------

    def export_markdown(self, conversation_id: int) -> str:
        parts = [f"# {self.title(conversation_id)}\n"]
        for m in self.messages(conversation_id):
            who = "You" if m.role == "user" else "Assistant"
            meta = f" <sub>{m.meta}</sub>" if m.meta else ""
            parts.append(f"## {who}{meta}\n\n{m.content.strip()}\n")
            if m.error:
                parts.append(f"> **Error:** {m.error}\n")
        return "\n".join(parts)

    def export_json(self, conversation_id: int) -> str:
        return json.dumps(
            {
                "title": self.title(conversation_id),
                "messages": [
                    {
                        "role": m.role,
                        "content": m.content,
                        "meta": m.meta,
                        "error": m.error,
                        "complete": m.complete,
                        "tokens": [asdict(t) for t in m.tokens],
                    }
                    for m in self.messages(conversation_id)
                ],
            },
            indent=2,
            ensure_ascii=False,
        )
