"""Logits processors: small classes behind one interface, each changing one request's next-token logits.

A processor edits a row of logits in place, given the tokens that row follows (the prompt and the output so
far). Rows are the distribution of *one* next token: under speculative decoding a request has several rows,
and row i follows the output plus the first i draft tokens, so every processor sees the history that row
really has. Processors run in the order ``build_processors`` lists them: penalties (which scale what the
model said), then the bias, then the masks (which remove tokens, so nothing after them can bring one back).

The penalties follow the definitions their names come from:
  * ``repetition_penalty`` (Keskar et al. 2019, as transformers' ``RepetitionPenaltyLogitsProcessor`` and
    vLLM): every token of prompt + output has its logit divided by the penalty if positive, multiplied if
    negative.
  * ``presence_penalty`` / ``frequency_penalty`` (OpenAI): subtract ``presence`` once from every token that
    appeared in the *output*, and ``frequency`` times its count.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional, Sequence

import torch

from ..request import SamplingParams

NEG_INF = float("-inf")


class LogitsProcessor(ABC):
    """One change to a request's logits. New processors subclass this and are added in ``build_processors``."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """Edit ``logits`` ([vocab], float32) in place: the distribution of the token after prompt + output."""


class RepetitionPenalty(LogitsProcessor):
    def __init__(self, penalty: float) -> None:
        self.penalty = penalty
        self._prompt_ids: Optional[torch.Tensor] = None     # the prompt's distinct tokens, found once

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        if self._prompt_ids is None:
            self._prompt_ids = torch.unique(torch.tensor(list(prompt_token_ids), dtype=torch.long))
        seen = self._prompt_ids
        if output_token_ids:
            seen = torch.unique(torch.cat([seen, torch.tensor(list(output_token_ids), dtype=torch.long)]))
        seen = seen.to(logits.device)
        scores = logits[seen]
        logits[seen] = torch.where(scores < 0, scores * self.penalty, scores / self.penalty)


class PresenceFrequencyPenalty(LogitsProcessor):
    def __init__(self, presence: float, frequency: float) -> None:
        self.presence, self.frequency = presence, frequency

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        if not output_token_ids:
            return
        # only the tokens that appeared: O(output), not O(vocabulary)
        ids, counts = torch.unique(torch.tensor(list(output_token_ids), dtype=torch.long), return_counts=True)
        ids = ids.to(logits.device)
        logits[ids] -= self.frequency * counts.to(logits.device, logits.dtype) + self.presence


class LogitBias(LogitsProcessor):
    """OpenAI's ``logit_bias``: a number added to chosen tokens' logits (-100 all but bans, 100 all but forces)."""

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        logits.index_add_(0, self.ids.to(logits.device), self.values.to(logits.device, logits.dtype))


class AllowedTokens(LogitsProcessor):
    """vLLM's ``allowed_token_ids``: every other token is masked out."""

    def __init__(self, allowed: Sequence[int], vocab_size: int) -> None:
        self.banned = torch.ones(vocab_size, dtype=torch.bool)
        self.banned[torch.tensor(list(allowed), dtype=torch.long)] = False

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        logits.masked_fill_(self.banned.to(logits.device), NEG_INF)


class MinTokens(LogitsProcessor):
    """vLLM's ``min_tokens``: the end-of-sequence and stop tokens are masked until the output is this long."""

    def __init__(self, min_tokens: int, stop_ids: Sequence[int]) -> None:
        self.min_tokens = min_tokens
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long)

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        if len(output_token_ids) < self.min_tokens and len(self.stop_ids):
            logits[self.stop_ids.to(logits.device)] = NEG_INF


class BadWordTable:
    """The token sequences of a request's bad words, built once for all its samples and looked up in O(1):
    a word's last token is banned where the output ends with the word's other tokens, so the table maps each
    prefix (by length) to the last tokens it bans. Each word counts as written and with a leading space."""

    def __init__(self, always: Sequence[int], by_prefix: dict[int, dict[tuple[int, ...], list[int]]]) -> None:
        self.always = torch.tensor(sorted(set(always)), dtype=torch.long)    # one-token words: banned everywhere
        self.by_prefix = by_prefix                                           # prefix length -> prefix -> banned

    @staticmethod
    def build(words: Sequence[str], tokenizer: Any, vocab_size: int) -> "BadWordTable":
        variants = [v for word in words for v in (word, " " + word.lstrip())]
        encoded = tokenizer(variants, add_special_tokens=False).input_ids if variants else []   # one batched call
        always: list[int] = []
        by_prefix: dict[int, dict[tuple[int, ...], list[int]]] = {}
        seen: set[tuple[int, ...]] = set()
        for ids in encoded:
            ids = tuple(ids)
            if not ids or ids in seen or any(not 0 <= t < vocab_size for t in ids):
                continue                          # a token outside the model's vocabulary is never generated
            seen.add(ids)
            if len(ids) == 1:
                always.append(ids[0])
            else:
                by_prefix.setdefault(len(ids) - 1, {}).setdefault(ids[:-1], []).append(ids[-1])
        return BadWordTable(always, by_prefix)

    def __bool__(self) -> bool:
        return bool(len(self.always) or self.by_prefix)


class BadWords(LogitsProcessor):
    """vLLM's ``bad_words``: a word's last token is banned wherever the output ends with the word's other
    tokens (a one-token word is banned everywhere); the work per row is one lookup per distinct word length."""

    def __init__(self, table: BadWordTable) -> None:
        self.table = table

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        if len(self.table.always):
            logits[self.table.always.to(logits.device)] = NEG_INF
        n = len(output_token_ids)
        for length, prefixes in self.table.by_prefix.items():
            if length <= n:
                banned = prefixes.get(tuple(output_token_ids[n - length:]))
                if banned:
                    logits[banned] = NEG_INF


def build_processors(params: SamplingParams, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int],
                     grammar: Optional[LogitsProcessor] = None,
                     bad_words: Optional[BadWordTable] = None) -> list[LogitsProcessor]:
    """The processors a request's parameters ask for, in the order they run (empty: the request skips the stage).
    ``bad_words``: the table already built for this request's parameters (else it is built here)."""
    processors: list[LogitsProcessor] = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenalty(params.repetition_penalty))
    if params.presence_penalty or params.frequency_penalty:
        processors.append(PresenceFrequencyPenalty(params.presence_penalty, params.frequency_penalty))
    if params.logit_bias:
        processors.append(LogitBias(params.logit_bias, vocab_size))
    if params.allowed_token_ids is not None:
        processors.append(AllowedTokens(params.allowed_token_ids, vocab_size))
    if params.bad_words:
        table = bad_words if bad_words is not None else BadWordTable.build(params.bad_words, tokenizer, vocab_size)
        if table:
            processors.append(BadWords(table))
    if params.min_tokens:
        stop_ids = [] if params.ignore_eos else list(eos_token_ids)
        processors.append(MinTokens(params.min_tokens, stop_ids + list(params.stop_token_ids)))
    if grammar is not None:
        processors.append(grammar)
    return processors
