"""Incremental detokenisation that keeps spaces and multi-byte characters right.

Decoding token by token loses the leading spaces of SentencePiece pieces and splits multi-byte
characters across byte-level tokens. A fast (Rust) tokenizer streams with the `tokenizers`
library's own DecodeStream, which holds bytes back until they form whole characters and keeps a
few tokens of context for the spaces. Other tokenizers decode a short window ending at the new
token and diff it against the same window without it, holding text back while it ends in an
incomplete character (U+FFFD). `make_detokenizer` picks one; both have `add(token_id) -> str`.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

CONTEXT_TOKENS = 4  # prompt tokens the first delta is decoded after, so its leading space is right


class IncrementalDetokenizer:
    """The window-diff detokeniser, for any tokenizer with `decode`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """The text this token completes (possibly empty while a character is incomplete)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return after[len(before) :]
        return ""


class StreamDetokenizer:
    """tokenizers.decoders.DecodeStream over a fast tokenizer's Rust backend: one step per token,
    no re-decoding of a window."""

    def __init__(self, backend, context_ids: list[int] | None = None):
        from tokenizers.decoders import DecodeStream

        self.backend = backend
        context = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        while context and backend.decode(context, skip_special_tokens=True).endswith("\ufffd"):
            context.pop()  # a prompt ending inside a character: the stream would repeat its text
        try:
            self.stream = DecodeStream(context, skip_special_tokens=True)
        except TypeError:  # tokenizers < 0.22 takes no context: step through it, dropping its text
            self.stream = DecodeStream(skip_special_tokens=True)
            for token_id in context:
                self.stream.step(backend, token_id)

    def add(self, token_id: int) -> str:
        """The text this token completes (empty while a character is incomplete)."""
        return self.stream.step(self.backend, int(token_id)) or ""


def make_detokenizer(tokenizer, context_ids: list[int] | None = None) -> IncrementalDetokenizer | StreamDetokenizer:
    """The streaming detokeniser for `tokenizer`: DecodeStream where it has a Rust backend that
    supports it, the window diff otherwise."""
    backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        try:
            return StreamDetokenizer(backend, context_ids)
        except (ImportError, TypeError, AttributeError):  # an older tokenizers without DecodeStream
            pass
    return IncrementalDetokenizer(tokenizer, context_ids)
