"""Verification: keep the drafts the target agrees with, so the output is exactly the target's.

The target model ran once over [last token, d_0 .. d_{k-1}] and gave k + 1 rows of logits: row i is the
target's distribution p_i for the token that follows d_0 .. d_{i-1}, the position d_i guessed. Walking the
drafts in order:

* greedy: accept d_i while it equals the argmax of row i, the token the target itself would have produced.
  At the first mismatch that argmax replaces d_i (the "recovered" token) and the later drafts are dropped.
  If every draft matches, row k gives one more token for free (the "bonus" token). Either way the tokens are
  exactly what plain greedy decoding produces, only several per forward pass.
* sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al.
  2023, "Accelerating LLM Decoding with Speculative Sampling"): accept d_i with probability
  min(1, p_i(d_i) / q_i(d_i)), where q_i is the distribution the drafter sampled it from (q = 1 for the
  n-gram lookup's single guess). On rejection, sample from max(p_i - q_i, 0), renormalised. The two cases
  together give every token with probability exactly p_i: the output distribution is the target's.

Temperature, top-k and top-p shape p before any of this (``minipaged.sampling.probabilities``), and the
uniforms come from the request's own seeded generator. vLLM does the same in
``vllm/v1/sample/rejection_sampler.py`` (batched on the GPU with Triton kernels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..request import SamplingParams
from ..sampling import probabilities
from .proposer import Draft


@dataclass(frozen=True)
class Verified:
    """The tokens a verification step appends: the accepted drafts, then one token from the target."""

    token_ids: list[int]
    num_accepted: int
    num_draft_tokens: int

    @property
    def bonus(self) -> bool:
        """True when every draft was accepted, so the last token came from the extra row k."""
        return self.num_accepted == self.num_draft_tokens


def recovered_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to sample a rejected position from: the part of p that q under-covers, max(p - q, 0)."""
    residual = torch.clamp(p - q, min=0.0)
    total = residual.sum()
    return residual / total if total > 0 else p      # p == q (up to rounding): a rejection was impossible


def greedy_verdict(target: list[int], draft_token_ids: list[int]) -> Verified:
    """Greedy verification from the target's argmax at each row: the agreeing drafts, then the target's token."""
    k, accepted = len(draft_token_ids), 0
    while accepted < k and draft_token_ids[accepted] == target[accepted]:
        accepted += 1
    return Verified(target[:accepted + 1], accepted, k)


def verify(target_logits: torch.Tensor, draft: Draft, params: SamplingParams,
           generator: torch.Generator) -> Verified:
    """``target_logits``: [len(draft) + 1, vocab], the target's rows at the last token and each draft."""
    k = len(draft.token_ids)
    if params.greedy:
        return greedy_verdict(target_logits.argmax(dim=-1).tolist(), draft.token_ids)
    p = probabilities(target_logits, params)                      # [k + 1, vocab]
    tokens: list[int] = []
    for i, token in enumerate(draft.token_ids):
        q_token = 1.0 if draft.probs is None else float(draft.probs[i, token])
        u = float(torch.rand((), generator=generator))
        if u * q_token < float(p[i, token]):                      # u < p/q without dividing by a tiny q
            tokens.append(token)
            continue
        q = draft.probs[i] if draft.probs is not None else torch.zeros_like(p[i]).index_fill_(0,
                                                                     torch.tensor([token]), 1.0)
        recovered = torch.multinomial(recovered_distribution(p[i], q), 1, generator=generator)
        return Verified(tokens + [int(recovered)], i, k)
    bonus = torch.multinomial(p[k], 1, generator=generator)
    return Verified(tokens + [int(bonus)], k, k)
