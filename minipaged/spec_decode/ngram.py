"""Prompt lookup (n-gram) drafting: if the text's last few tokens appeared before, guess what followed.

Rewriting, quoting, editing and code completion repeat their input, so the tokens that followed an
earlier occurrence of the current suffix are often the next ones. No model runs: the draft costs a search.

The rule is vLLM's (``vllm/v1/spec_decode/ngram_proposer.py``): try the longest suffix first (from
``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens); among equal lengths take the earliest
occurrence; propose up to k tokens that followed it (fewer if the text ends first), never past max_model_len.
vLLM finds the match with a KMP pass over the reversed tokens; ``find_ngram_continuation`` says the same thing
with a scan for the suffix's first token.
"""
from __future__ import annotations

from typing import Sequence

from ..request import Request
from .proposer import Draft


def find_ngram_continuation(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up-to-k tokens that followed the earliest earlier occurrence of the longest matching suffix.

    The candidates are the places where the suffix's first token occurs, found by ``list.index`` (a scan in C);
    only there are the other n - 1 tokens compared. A scan a step reads the text again each time, but in C: a
    few microseconds for a few hundred tokens. (An index of every n-gram, kept as tokens come, costs a tuple and
    a dictionary entry per token and n: more, measured, than the scans of a request that generates a hundred
    tokens after a long prompt.)"""
    total = len(tokens)
    if k <= 0:
        return []
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n:]
        first, start = suffix[0], 0
        while True:
            try:
                start = tokens.index(first, start, total - n)    # an occurrence that ends before the suffix does
            except ValueError:
                break
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
            start += 1
    return []


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, requests: Sequence[Request], max_drafts: dict[str, int]) -> dict[str, Draft]:
        drafts: dict[str, Draft] = {}
        for req in requests:
            guess = find_ngram_continuation(req.all_token_ids, self.min_n, self.max_n, max_drafts[req.request_id])
            if guess:
                drafts[req.request_id] = Draft(guess)
        return drafts

    def forget(self, request_id: str) -> None:
        """Nothing to drop: the lookup reads the request's tokens afresh every step."""
