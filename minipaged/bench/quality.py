"""What weight-only int8 costs in quality, measured against fp32 on the same weights: greedy-token agreement
over chat prompts and the perplexity of a fixed text (bench/quantization.py, and the slow test that holds
SmolLM2's agreement to a floor)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..engine import Engine
from ..request import SamplingParams


@dataclass
class Agreement:
    """Greedy outputs of the int8 engine against the fp32 engine's, prompt by prompt."""

    prompts: int
    tokens: int                   # fp32 tokens compared (max_tokens per prompt, fewer where fp32 stopped)
    identical_outputs: int        # prompts whose whole int8 output equals fp32's
    prefix_agreement: float       # share of fp32's tokens that int8 matched before its first different token
    teacher_forced: float         # share of fp32's tokens that int8 picks given fp32's own text before it

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def greedy_agreement(fp32: Engine, int8: Engine, reference_int8: torch.nn.Module, prompts: list[list[int]],
                     max_tokens: int) -> Agreement:
    """Generate every prompt greedily with both engines. ``reference_int8`` (transformers' model on the int8
    weights' dequantized values: ``minipaged.model.int8_reference``, equal to the int8 engine's logits to
    float rounding) scores the teacher-forced agreement, where one early difference does not decide the rest."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ours = fp32.generate(prompts, params, use_tqdm=False)
    theirs = int8.generate(prompts, params, use_tqdm=False)
    tokens = identical = prefix = forced = 0
    for prompt, a, b in zip(prompts, ours, theirs):
        want, got = list(a.token_ids), list(b.token_ids)
        tokens += len(want)
        identical += want == got
        common = 0
        while common < min(len(want), len(got)) and want[common] == got[common]:
            common += 1
        prefix += common
        with torch.no_grad():
            logits = reference_int8(torch.tensor([prompt + want])).logits[0, len(prompt) - 1:-1]
        forced += int((logits.argmax(-1) == torch.tensor(want)).sum())
    return Agreement(len(prompts), tokens, identical, prefix / max(tokens, 1), forced / max(tokens, 1))


def perplexity(hf_model: torch.nn.Module, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token given the ones before it."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
    return math.exp(float(nll))
