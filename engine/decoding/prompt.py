"""Prompt text from the outside world: the invalid-bytes policy and the context-overflow policy.

Invalid bytes: text that is not valid UTF-8 (bytes on standard input; on the command line Python
keeps undecodable bytes as lone surrogates) has each bad byte replaced by U+FFFD, and the caller
says so in one line. Context overflow: a prompt must leave room for the answer inside the model's
context; `fit_turns` drops the oldest turns (never a system turn, never the last one) until it does,
or refuses, by the policy the user chose (limits.OVERFLOW_POLICIES).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


class PromptError(ValueError):
    """A prompt that cannot be run as given; the message is one line for the user."""


def clean_text(text: str) -> tuple[str, int]:
    """`text` with lone surrogates (undecodable bytes, broken escapes) replaced by U+FFFD, and how many."""
    cleaned, count = _SURROGATE.subn(REPLACEMENT, text)
    return cleaned, count


def decode_bytes(data: bytes) -> tuple[str, int]:
    """UTF-8 `data` as text, each invalid byte sequence replaced by U+FFFD, and how many were."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        return text, text.count(REPLACEMENT) - data.count(REPLACEMENT.encode())


def replaced_warning(count: int, where: str) -> str:
    return (f"warning: {count} invalid byte sequence{'s' if count != 1 else ''} in {where} "
            f"replaced by {REPLACEMENT} (the text is read as UTF-8)")


def answer_room(context: int, max_new_tokens: int) -> int:
    """Tokens a prompt must leave free: the whole answer, up to a quarter of the context."""
    return max(1, min(max_new_tokens, context // 4))


@dataclass(frozen=True)
class Fitted:
    """A prompt made to fit: its ids, how many turns (or, for plain text, tokens) were dropped, and the
    line to show the user when something was (None otherwise)."""

    ids: tuple[int, ...]
    context: int | None
    dropped: int = 0
    notice: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.ids)


def overflow_message(tokens: int, room: int, context: int, what: str) -> str:
    return (f"{what} is {tokens:,} tokens and the answer needs up to {room:,} more, but the model's context holds "
            f"{context:,}: shorten it, start a new conversation, or set the context overflow policy to "
            f"'drop_oldest'")


def _room_to_make(tokens: int, context: int | None, max_new_tokens: int, policy: str, what: str) -> int | None:
    """None when a prompt of `tokens` leaves the answer room (or the context is unknown); else the room the
    answer needs, when the policy drops, and PromptError when it stops."""
    if context is None:
        return None
    room = answer_room(context, max_new_tokens)
    if tokens + room <= context:
        return None
    if policy != "drop_oldest":
        raise PromptError(overflow_message(tokens, room, context, what))
    return room


def fit_turns(messages: Sequence[dict[str, str]], encode: Callable[[list[dict[str, str]]], list[int]],
              context: int | None, max_new_tokens: int, policy: str) -> Fitted:
    """The chat `messages` encoded so that the answer has room in `context` (None: no known limit).

    policy "stop" raises PromptError when they do not fit; "drop_oldest" drops the oldest non-system
    turns one at a time (the last turn always stays) and raises only when the system turns and the
    last turn alone do not fit."""
    kept = list(messages)
    ids = encode(kept)
    room = _room_to_make(len(ids), context, max_new_tokens, policy, "The conversation")
    if room is None:
        return Fitted(tuple(ids), context)
    dropped = 0
    while len(ids) + room > context:
        at = next((i for i, m in enumerate(kept[:-1]) if m["role"] != "system"), None)
        if at is None:
            raise PromptError(overflow_message(len(ids), room, context, "The last message with the system prompt"))
        # the oldest turn and the answers after it, up to the next user turn: the roles keep alternating,
        # as many chat templates require
        del kept[at]
        dropped += 1
        while at < len(kept) - 1 and kept[at]["role"] not in ("user", "system"):
            del kept[at]
            dropped += 1
        ids = encode(kept)
    notice = (f"Dropped the {dropped} oldest turn{'s' if dropped != 1 else ''} to fit the model's context of "
              f"{context:,} tokens (the prompt is now {len(ids):,}).")
    return Fitted(tuple(ids), context, dropped, notice)


def fit_ids(ids: Sequence[int], context: int | None, max_new_tokens: int, policy: str,
            keep_first: int = 0) -> Fitted:
    """Plain-text prompt ids made to fit: "drop_oldest" keeps the first `keep_first` (a BOS token) and the
    newest tokens, "stop" refuses."""
    room = _room_to_make(len(ids), context, max_new_tokens, policy, "The prompt")
    if room is None:
        return Fitted(tuple(ids), context)
    keep = context - room - keep_first
    dropped = len(ids) - keep_first - keep
    return Fitted(tuple(ids[:keep_first]) + tuple(ids[-keep:]), context, dropped,
                  f"Dropped the first {dropped:,} tokens of the prompt to fit the model's context of {context:,} tokens.")
