"""Incremental detokenising: the text of each new token at constant cost, whatever the output's length.

Decoding the whole output after every token is the obvious way and a quadratic one: token 2,000 decodes
2,000 tokens again. Decoding each token alone is wrong: tokenizers join pieces in context (SentencePiece
drops the leading space of the first token it decodes; a byte-level BPE splits one UTF-8 character over
several tokens). vLLM's detokenizer keeps two offsets into the output instead, and so does this one:

    tokens:  ... [prefix_offset ........ read_offset) [new tokens ...]
                  already printed, kept as context      not printed yet

Each step decodes the short window twice, with and without the new tokens; the new text is the
difference. The context makes the join come out as a full decode would, and the window slides forward
whenever the new text is complete, so every token is decoded a bounded number of times.

While the new text ends in U+FFFD (the replacement character: the tokens so far end in the middle of a
multi-byte character) nothing is printed and the window waits for the rest of the character.
"""
from __future__ import annotations

from typing import Any, Sequence

INCOMPLETE_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text, grown one token at a time. ``text`` always equals a full decode of the
    tokens so far (special tokens skipped unless ``skip_special_tokens`` is False), minus a trailing incomplete
    character."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0      # the window's context starts here
        self.read_offset = 0        # tokens before this are in ``text``

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text they complete ("" while a character is still incomplete)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if new_text.endswith(INCOMPLETE_CHARACTER):
            return ""                                  # wait for the rest of a multi-byte character
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
