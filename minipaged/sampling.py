"""Turning logits into the next token, one row per request that reached the end of its known tokens.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p (nucleus), and draw
with the request's own ``torch.Generator``: a request's random stream depends only on its seed, never on
which other requests share the batch, so seeded outputs are reproducible under any scheduling.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .kernels import torch_argmax
from .request import Request, SamplingParams, fail_request


class Sampler:
    def __init__(self, engine_seed: int,
                 argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax) -> None:
        self.engine_seed = engine_seed
        self.argmax = argmax               # [rows, vocab] -> [rows]: the engine's backend may bring a faster one
        self._generators: dict[str, torch.Generator] = {}

    def generator_for(self, req: Request) -> torch.Generator:
        gen = self._generators.get(req.request_id)
        if gen is None:
            # any integer seed, folded into the 64 bits torch.Generator takes
            seed = (req.params.seed + req.sample_index) % 2**64 if req.params.seed is not None else \
                hash((self.engine_seed, req.arrival_index)) & 0x7FFF_FFFF_FFFF
            gen = torch.Generator(device="cpu").manual_seed(seed)
            self._generators[req.request_id] = gen
        return gen

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request], rows: Optional[Sequence[int]] = None,
               argmax: Optional[Sequence[int]] = None) -> list[Optional[int]]:
        """logits: [len(requests), vocab] float32, or (``rows``) any number of rows, of which request i samples
        row ``rows[i]``; ``argmax``: every row's argmax when the caller already has it (a step that verifies
        drafts works it out for all its rows: the plain decodes beside them need no copy of their rows then).
        Returns one token id per request, or None for a request whose sampling failed: the engine aborts that
        one request and serves the others."""
        picked = range(len(requests)) if rows is None else rows
        tokens: list[Optional[int]] = [None] * len(requests)
        if argmax is not None:
            tokens = [argmax[i] for i in picked]
        elif any(req.params.greedy for req in requests):
            tokens = self.argmax(logits if rows is None else logits[list(rows)]).tolist()
        for row, req in enumerate(requests):
            if req.error is not None:            # the logits stage failed it: nothing to sample
                tokens[row] = None
            elif not req.params.greedy:
                try:
                    tokens[row] = self._sample_row(logits[picked[row]], req)
                except Exception as exc:
                    fail_request(req, f"sampling failed ({type(exc).__name__}: {exc}).")
                    tokens[row] = None
        return tokens

    def _sample_row(self, logits: torch.Tensor, req: Request) -> int:
        probs = probabilities(logits, req.params)
        return int(torch.multinomial(probs, 1, generator=self.generator_for(req)).item())


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from: temperature, then top-k, then top-p (nucleus).

    ``logits`` is one row [vocab] or several [rows, vocab] (speculative decoding verifies several positions
    of one request at once); the result has the same shape, on the CPU, in float32.
    """
    logits = logits.float().cpu() / params.temperature
    if params.top_k and 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already cover top_p of the mass
        drop = probs.cumsum(-1) - probs > params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)
