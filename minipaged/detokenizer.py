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

The same two-offset window exists in Rust inside the tokenizers library, as ``tokenizers.decoders.DecodeStream``
(what vLLM uses for fast tokenizers): one call into Rust a token instead of two decodes through transformers'
Python ``decode`` (bench/host_overhead.py measures what that saves a step: docs/performance.md, "A step's
host time"). A fast tokenizer whose ``decode`` is its backend's decode as it is (no clean-up of spaces)
streams through it; any other tokenizer takes the window below. The two differ in one case: the stream keeps its window when a token adds
no text (a skipped special token), where the window below restarts after it, so that a decoder stripping the
first leading space (Llama 2's) loses the space of the piece after it; the stream gives the full decode.
If the stream refuses a step (a byte-fallback run that is not UTF-8 changes text already printed: vLLM issue
17448), the request goes on with the window from where the stream stopped.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

INCOMPLETE_CHARACTER = "\ufffd"
WINDOW_CONTEXT = 5      # tokens of context a window restarted mid-output gets before its first new token (vLLM's)


def streaming_backend(tokenizer: Any) -> Optional[Any]:
    """The tokenizers-library ``Tokenizer`` behind ``tokenizer`` when a ``DecodeStream`` over it gives the text of
    ``tokenizer.decode(ids, skip_special_tokens=...)``; else None. transformers' fast tokenizers decode with
    their backend and then, if ``clean_up_tokenization_spaces`` is on, may remove spaces before punctuation in
    Python, which a stream of the backend would not do: those take the window."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers import Tokenizer
        from tokenizers.decoders import DecodeStream  # noqa: F401  (tokenizers >= 0.21 has it)
    except ImportError:
        return None
    return backend if isinstance(backend, Tokenizer) else None


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
        self._backend = streaming_backend(tokenizer)
        self._stream: Optional[Any] = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def streaming(self) -> bool:
        """Whether the tokenizers library's ``DecodeStream`` does the work (else the window in Python)."""
        return self._stream is not None

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text they complete ("" while a character is still incomplete)."""
        if self._stream is not None:
            return self._add_streaming(new_token_ids)
        self.token_ids.extend(new_token_ids)
        return self._add_windowed()

    def _add_streaming(self, new_token_ids: Sequence[int]) -> str:
        delta = ""
        for i, token in enumerate(new_token_ids):
            self.token_ids.append(token)
            try:
                piece = self._stream.step(self._backend, token)
            except Exception:           # the stream refused this step: the window in Python goes on from here
                self._stream = None
                self.text += delta
                self.token_ids.extend(new_token_ids[i + 1:])
                self.prefix_offset = max(0, self.read_offset - WINDOW_CONTEXT)
                return delta + self._add_windowed()
            if piece:
                delta += piece
                self.read_offset = len(self.token_ids)       # every token so far is in the text
        self.text += delta
        return delta

    def _add_windowed(self) -> str:
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
