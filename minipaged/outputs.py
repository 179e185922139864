"""What the engine gives back to its caller: each step's per-request deltas, and a finished request's
``RequestOutput`` (vLLM's shapes).

This is the engine's output boundary, as in vLLM v1 (``EngineCore.step`` returns ``EngineCoreOutputs``; stats
and KV events travel on their own channels): ``Engine.step()`` returns a ``StepResult`` whose ``outputs`` are
what clients get (new tokens, text, log-probabilities, finish reasons, the final output), and whose ``event``
is what observers get (the TUI, traces, metrics, the web view). A client never reads tokens out of an event.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .events import StepEvent


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
    # Tokens generated: len(token_ids), also where a "delta" output kind leaves token_ids empty (request.py)
    num_tokens: int = 0

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


# The step's deltas are built for every request every step, so they are plain slotted dataclasses: a frozen one
# costs ~3.5x as much to make (each field set through object.__setattr__), ~0.3 ms a step at 256 requests.
# Nobody changes them once made.
@dataclass(slots=True)
class SampleDelta:
    """What one sample (choice ``index`` of its request) got in one step."""

    index: int
    text: str                                   # the text that may go out now (a possible stop string held back)
    token_ids: tuple[int, ...]                  # the tokens the step appended
    logprobs: tuple[PositionLogprobs, ...] = () # one per new token, when SamplingParams.logprobs is set
    finish_reason: Optional[str] = None         # "stop", "length" or "abort", in the sample's last delta only


@dataclass(slots=True)
class RequestDelta:
    """One request's share of a step: a delta for each of its samples that changed, and its final
    ``RequestOutput`` in the step where its last sample finished. A stream is made of these."""

    request_id: str                             # the id ``add_request`` returned (never a sample's own id)
    samples: tuple[SampleDelta, ...]            # by index
    prompt_logprobs: Optional[list[Optional[PositionLogprobs]]] = None   # in the first delta, when asked
    output: Optional[RequestOutput] = None

    @property
    def finished(self) -> bool:
        return self.output is not None

    @staticmethod
    def merged(deltas: list["RequestDelta"]) -> "RequestDelta":
        """One request's consecutive deltas as a single one: what a reader that fell behind sends at once (vLLM's
        output collector merges a slow consumer's outputs the same way), so the server writes one chunk where it
        had several, and catches up instead of falling further behind. Each piece is joined once (linear)."""
        pieces: dict[int, list[SampleDelta]] = {}
        for delta in deltas:
            for sample in delta.samples:
                pieces.setdefault(sample.index, []).append(sample)
        samples = tuple(SampleDelta(i, "".join(s.text for s in ss), tuple(t for s in ss for t in s.token_ids),
                                    tuple(p for s in ss for p in s.logprobs), ss[-1].finish_reason)
                        for i, ss in sorted(pieces.items()))
        return RequestDelta(deltas[0].request_id, samples, next(
            (d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None), deltas[-1].output)


@dataclass(frozen=True)
class StepResult:
    """What ``Engine.step()`` returns: ``outputs`` for clients, ``event`` for observers (it only observes)."""

    outputs: tuple[RequestDelta, ...]
    event: "StepEvent"
