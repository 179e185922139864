"""Prompt lookup (n-gram) drafting: if the text's last few tokens appeared before, guess what followed.

Rewriting, quoting, editing and code completion repeat their input, so the tokens that followed an
earlier occurrence of the current suffix are often the next ones. No model runs: the draft costs a search.

The rule is vLLM's (``vllm/v1/spec_decode/ngram_proposer.py``): try the longest suffix first (from
``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens); among equal lengths take the earliest
occurrence; propose up to k tokens that followed it (fewer if the text ends first), never past max_model_len.
vLLM finds the match with a KMP pass over the reversed tokens; ``find_ngram_continuation`` says the same thing
readably with a plain scan, and ``NgramIndex`` (what the proposer uses) answers it without reading the text again.
"""
from __future__ import annotations

from typing import Sequence

from ..request import Request
from .proposer import Draft


def find_ngram_continuation(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-k tokens that followed the earliest earlier occurrence of the longest matching suffix."""
    total = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = list(tokens[total - n:])
        first = suffix[0]
        for start in range(0, total - n):                # an occurrence that ends before the suffix does
            if tokens[start] == first and list(tokens[start:start + n]) == suffix:
                return list(tokens[start + n:start + n + k])
    return []


class NgramIndex:
    """Where each n-gram of one request's text first starts (n from min_n to max_n), kept up as its tokens come.

    ``find_ngram_continuation`` reads the whole text at every step: 3 scans of it a request a step, 0.1 ms at a few
    hundred tokens and a millisecond at thousands, in Python. The index reads each token once, when it comes; a
    step's lookup is then a dictionary read per n. It keeps only an n-gram's earliest start, which is the one the
    rule asks for: the suffix's own occurrence is its latest, so a start before it is an earlier occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self.first_start: dict[tuple[int, ...], int] = {}

    def extend(self, new_tokens: Sequence[int]) -> None:
        tokens, first_start = self.tokens, self.first_start
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first_start.setdefault(tuple(tokens[end - n:]), end - n)

    def continuation(self, k: int) -> list[int]:
        """What ``find_ngram_continuation(self.tokens, min_n, max_n, k)`` says, without a scan."""
        tokens, total = self.tokens, len(self.tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self.first_start[tuple(tokens[total - n:])]        # there: the suffix itself starts somewhere
            if start < total - n:
                return tokens[start + n:start + n + k]
        return []


class NgramProposer:
    """The n-gram lookup for every request, each with its own ``NgramIndex`` (dropped when the request ends)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Sequence[Request], max_drafts: dict[str, int]) -> dict[str, Draft]:
        drafts: dict[str, Draft] = {}
        for req in requests:
            index = self._indexes.get(req.request_id)
            if index is None:
                index = self._indexes[req.request_id] = NgramIndex(self.min_n, self.max_n)
            index.extend(req.token_ids_between(len(index.tokens), req.num_tokens))
            guess = index.continuation(max_drafts[req.request_id])
            if guess:
                drafts[req.request_id] = Draft(guess)
        return drafts

    def forget(self, request_id: str) -> None:
        """The request ended (or lost its KV: its tokens stay, but the index is rebuilt when it drafts again)."""
        self._indexes.pop(request_id, None)
