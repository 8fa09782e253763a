"""Incremental detokenisation that keeps spaces and multi-byte characters right.

Decoding token by token loses the leading spaces of SentencePiece pieces and splits multi-byte
characters across byte-level tokens. Instead decode a short window ending at the new token and
diff it against the same window without it; hold text back while it ends in an incomplete
character (U+FFFD).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, context_ids: list[int] | None = None):
        self.tokenizer = tokenizer
        # a few context tokens so the first delta gets its leading space right
        self.ids: list[int] = list(context_ids[-4:]) if context_ids else []
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
