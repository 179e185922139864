"""What a finished request gives back to the caller (vLLM's RequestOutput shape)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: Optional[float]
    num_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        """Time to first token: arrival until the first generated token exists."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``); rank 1 is the most likely token."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


@dataclass(frozen=True)
class TokenLogprobs:
    """The engine's raw numbers for one position (the logits stage computes them): the token that is there,
    its log-probability and rank, and the N most likely tokens; the output processor adds their text."""

    token_id: int
    logprob: float
    rank: int                                  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]         # (token id, log-probability), most likely first


# One position: token id -> Logprob, the N most likely first, then the chosen token if it is not among them.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str]          # "stop", "length" or "abort"
    stop_reason: Optional[str | int] = None
    token_times: list[float] = field(default_factory=list)
    logprobs: Optional[list[PositionLogprobs]] = None     # one per token, when SamplingParams.logprobs is set
    error: Optional[str] = None           # why an "abort" happened, when serving it failed (a server answers it)

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: the gaps between consecutive generated tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics
    finished: bool = True
    # One per prompt token (the first is None: nothing comes before it), when SamplingParams.prompt_logprobs is set
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None

    # The common case is one sample per prompt: these read its first (only) completion.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> Optional[str]:
        return self.outputs[0].finish_reason
