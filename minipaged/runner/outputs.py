"""What one step's forward pass hands back (vLLM v1's ``vllm/v1/outputs.py``): the new tokens and everything
computed beside them, in one ``ModelRunnerOutput``, and where the forward pass's time went (``StepTimes``).

Kept apart from the executor that fills them: the engine core and the observers' recorder read these types,
and importing them must not import torch, the model or the sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..logits.logprobs import TokenLogprobs
    from ..request import Request
    from ..spec_decode.rejection_sampler import Verified


@dataclass(frozen=True)
class StepTimes:
    """Where the forward-pass part of a step went, in seconds. The host's work outside the forward pass is
    ``prepare_s + model_s - forward_s`` (and, around it, the engine's scheduling and output processing)."""

    prepare_s: float = 0.0               # the batch's input tensors (runner.prepare)
    forward_s: float = 0.0               # the model's forward call, on the host's clock, in the calling thread
    device_s: Optional[float] = None     # CUDA: the device's time for that forward (CUDA events); None: host-computed
    model_s: float = 0.0                 # from the forward's start: forward, logits stage and sampling


@dataclass
class ModelRunnerOutput:
    """Everything one forward pass produced: the one way its results leave it."""

    sampled: dict[str, Optional[list[int]]] = field(default_factory=dict)  # new tokens (None: sampling failed)
    verified: dict[str, Verified] = field(default_factory=dict)     # the rejection sampler's verdict on drafts
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)   # of the new tokens, when asked
    prompt_logprobs: list[tuple[Request, int, list[TokenLogprobs]]] = field(default_factory=list)  # (req, first, ..)
    constrained: dict[str, int] = field(default_factory=dict)       # tokens a grammar allowed (its first row)
    times: StepTimes = field(default_factory=StepTimes)
