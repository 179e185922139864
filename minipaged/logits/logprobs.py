"""Log-probabilities as the caller asked for them: the chosen token's, its rank, and the top N.

They are the raw model's (log_softmax of the logits the forward pass gave, before the logits stage,
temperature, top-k or top-p), as vLLM returns by default; under speculative decoding they are the target
model's rows. The numbers leave here as plain Python values; the output processor adds the token text.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..outputs import TokenLogprobs


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def token_logprobs(logprob_rows: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """Row i holds the distribution token_ids[i] was drawn from (or is scored against, for a prompt)."""
    n = min(len(token_ids), logprob_rows.shape[0])
    if n == 0:
        return []
    rows = logprob_rows[:n].cpu()
    ids = torch.tensor(list(token_ids[:n]), dtype=torch.long)
    chosen = rows.gather(1, ids[:, None])[:, 0]
    ranks = (rows > chosen[:, None]).sum(dim=1) + 1
    top_values, top_ids = torch.topk(rows, num_top, dim=-1) if num_top else (rows[:, :0], ids[:, None][:, :0])
    return [TokenLogprobs(int(t), float(lp), int(r), tuple(zip(ti.tolist(), tv.tolist())))
            for t, lp, r, ti, tv in zip(ids.tolist(), chosen.tolist(), ranks.tolist(), top_ids, top_values)]


def prompt_logprobs(logits: torch.Tensor, prompt_token_ids: Sequence[int], first: int,
                    num_top: int) -> list[TokenLogprobs]:
    """Rows scoring prompt tokens ``first, first + 1, ...`` (row i is the position before each)."""
    return token_logprobs(log_softmax_rows(logits), prompt_token_ids[first:first + logits.shape[0]], num_top)


@dataclass
class StageResult:
    """What the stage took from a step's rows: the raw log-probabilities asked for (rows and top N, paired with
    the tokens once they are sampled: ``sampled_logprobs``) and the grammar constraints (tokens allowed)."""

    raw_logprobs: dict[str, tuple[torch.Tensor, int]] = field(default_factory=dict)
    constrained: dict[str, int] = field(default_factory=dict)


def sampled_logprobs(raw: dict[str, tuple[torch.Tensor, int]],
                     sampled: dict[str, Optional[list[int]]]) -> dict[str, list[TokenLogprobs]]:
    """The raw log-probabilities of each request's new tokens (row j scored the j-th new token)."""
    return {rid: token_logprobs(lp, sampled[rid], num_top)
            for rid, (lp, num_top) in raw.items() if sampled.get(rid)}
