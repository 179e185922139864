"""What every drafter hands the engine: k guessed tokens per request (and, for a model, its probabilities).

Drafts are cheap guesses of the next tokens. The target model then checks them all in one forward pass
(see ``rejection_sampler``); a wrong guess costs only the compute of its position, never correctness.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from ..request import Request


@dataclass
class Draft:
    """One request's guesses for its next ``len(token_ids)`` tokens.

    ``probs[i]`` is the distribution the drafter sampled ``token_ids[i]`` from (after the request's
    temperature, top-k and top-p); ``None`` means the drafter was deterministic (n-gram lookup, or a greedy
    request): q is then 1 for the proposed token and 0 elsewhere.
    """

    token_ids: list[int]
    probs: Optional[torch.Tensor] = None     # [len(token_ids), vocab]

    def trimmed(self, k: int) -> "Draft":
        """The first k guesses (the scheduler may schedule fewer than were proposed)."""
        if k >= len(self.token_ids):
            return self
        return Draft(self.token_ids[:k], None if self.probs is None else self.probs[:k])


class Proposer(Protocol):
    """Drafting after a step, for requests whose next step is a decode."""

    def propose(self, requests: Sequence[Request], max_drafts: dict[str, int]) -> dict[str, Draft]:
        """Up to ``max_drafts[request_id]`` guesses per request; a request with no guess may be left out."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished or lost its KV (preempted): drop whatever is kept for it."""
        ...
