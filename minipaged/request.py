"""A request, its sampling parameters and its life cycle.

The one number that drives scheduling is ``num_computed_tokens``: how many of the request's tokens
(prompt, then generated ones) already have their keys and values in the KV cache. Each step the scheduler
grants ``num_new_tokens``: a whole prompt, a chunk of it, or one decode token. Prefill and decode differ
only in that number (vLLM v1's unified view).

    WAITING_FOR_GRAMMAR --compiled--> WAITING --admit--> RUNNING --finish--> FINISHED_*
                                         ^                  |  \\
                                         |   preempt        |   \\ preempt (swap)
                                         +---(recompute)----+    +--> SWAPPED --swap in--> RUNNING

A request with structured outputs waits in WAITING_FOR_GRAMMAR, outside the scheduler, while its grammar
compiles in a background thread (``logits.structured``); the step loop never waits for a compiler.
"""
from __future__ import annotations

import enum
import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from .validation import is_int, is_number

logger = logging.getLogger("minipaged")


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                         RequestStatus.FINISHED_ABORTED)


class InvalidRequestError(ValueError):
    """A request the engine refuses; the message says what is wrong and how to fix it. ``param`` names the
    field at fault (the server answers it as OpenAI's ``param``)."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


INT64_MAX = 2**63 - 1           # token ids travel as int64 tensors: a larger integer cannot even be stored


def check_token_ids(name: str, ids: Sequence[int], vocab_size: Optional[int] = None) -> None:
    """Every id an integer in the vocabulary (``0..vocab_size-1``; without a vocabulary, 0..2**63-1): one
    out-of-range id would otherwise index the logits inside a step, where it fails the batch, not the request."""
    top = INT64_MAX if vocab_size is None else vocab_size - 1
    bad = [t for t in ids if not is_int(t) or not 0 <= t <= top]
    if bad:
        where = "the int64 range of token ids" if vocab_size is None else "the vocabulary"
        raise InvalidRequestError(f"{name} has token id(s) {[_short(t) for t in bad[:5]]} outside {where} "
                                  f"(0..{top}).", name)


def _short(value: Any) -> Any:
    """A value for an error message: a 1e30-sized integer as its first digits."""
    text = repr(value)
    return value if len(text) <= 24 else text[:20] + "..."


STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (``json``, a dict or its JSON text), any JSON object (``json_object``),
    a regular expression, a list of choices, or an EBNF grammar (xgrammar's GBNF dialect), as vLLM's
    ``StructuredOutputsParams``."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[Sequence[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of json, regex, choice, grammar or json_object; got "
                f"{given or 'none'}.", "structured_outputs")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured outputs 'choice' must be a non-empty list of strings.",
                                      "structured_outputs.choice")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured outputs '{name}' must be a non-empty string.",
                                          f"structured_outputs.{name}")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n))

    def schema_text(self) -> str:
        """The JSON schema as text (a dict is dumped; text is checked to be JSON)."""
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
            return self.json
        return json.dumps(self.json)

    @staticmethod
    def from_any(value: Any) -> Optional["StructuredOutputsParams"]:
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if isinstance(value, dict):
            unknown = [k for k in value if k not in STRUCTURED_KEYS]
            if unknown:
                raise InvalidRequestError(f"structured_outputs has no field {str(unknown[0])!r}; it takes one of "
                                          f"{', '.join(STRUCTURED_KEYS)}.", f"structured_outputs.{unknown[0]}")
            return StructuredOutputsParams(**value)
        raise InvalidRequestError("structured_outputs must be a StructuredOutputsParams or a dict of its fields.",
                                  "structured_outputs")


OUTPUT_KINDS = ("cumulative", "delta")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's names).

    temperature 0 means greedy. ``seed`` makes a sampled request reproducible whatever else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0                 # 0 or -1: off
    top_p: float = 1.0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    # The logits stage (minipaged.logits): penalties, biases and masks, applied before sampling.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    min_tokens: int = 0
    allowed_token_ids: Optional[Sequence[int]] = None
    bad_words: Optional[Sequence[str]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Log-probabilities of the raw model (before the logits stage): top-N per generated / prompt token.
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    priority: int = 0              # --scheduling-policy priority: lower values are admitted first (vLLM's rule)
    # Who sent it (the server's API key or address), for fair share by client (EngineConfig.fair_share): the
    # scheduler shares steps and KV blocks between clients first. None: the one anonymous client. Not vLLM's.
    client: Optional[str] = None
    # The output text (vLLM's names): special tokens left out of it, and the stop string cut off it, by default.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What the request's final RequestOutput repeats (vLLM's RequestOutputKind): "cumulative", every token, its
    # text, times and log-probabilities (what `generate` returns); "delta", none of them, only how each sample
    # ended and its counts, for a caller that read them all in the step deltas (a stream: `serve` asks it for
    # streamed requests, so that the core does not send a long answer twice, nor keep its log-probabilities).
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids"):        # None is vLLM's default for both
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop_token_ids, int) or not isinstance(self.stop_token_ids, Sequence):
            raise InvalidRequestError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}.")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._normalise_logits_fields()
        self.validate()

    def _normalise_logits_fields(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequestError("logit_bias must map token ids to biases, e.g. {\"50256\": -100}.")
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise InvalidRequestError("logit_bias keys must be token ids and values numbers.") from None
            object.__setattr__(self, "logit_bias", bias)
        for name in ("allowed_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is not None:
                if isinstance(value, (str, int)) or not isinstance(value, Sequence):
                    raise InvalidRequestError(f"{name} must be a list, got {value!r}.")
                object.__setattr__(self, name, tuple(value))
        try:
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams.from_any(self.structured_outputs))
        except TypeError as exc:
            raise InvalidRequestError(str(exc)) from None

    def validate(self) -> None:
        if not is_int(self.n) or self.n < 1:
            raise InvalidRequestError(f"n must be an integer >= 1, got {self.n!r}.", "n")
        if not is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0 (0 is greedy), got "
                                      f"{self.temperature!r}.", "temperature")
        if not is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}.", "top_k")
        if not is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}.", "top_p")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.", "max_tokens")
        if not is_int(self.priority):
            raise InvalidRequestError(f"priority must be an integer (lower is served first), got {self.priority!r}.",
                                      "priority")
        if self.client is not None and not isinstance(self.client, str):
            raise InvalidRequestError(f"client must be None or a string (who sent the request), got "
                                      f"{self.client!r}.", "client")
        if self.seed is not None and not is_int(self.seed):
            raise InvalidRequestError(f"seed must be None or an integer, got {self.seed!r}.", "seed")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be a list of non-empty strings.", "stop")
        if self.output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                                      f"{self.output_kind!r}.", "output_kind")
        check_token_ids("stop_token_ids", self.stop_token_ids)
        self._validate_logits_fields()

    def _validate_logits_fields(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2] (OpenAI's range), got {value!r}.", name)
        if not is_number(self.repetition_penalty) or not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0:
            raise InvalidRequestError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 100] (1 is off, "
                                      f"below 1 favours repeats), got {self.repetition_penalty!r}: send a value in "
                                      f"that range.", "repetition_penalty")
        if self.logit_bias and any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise InvalidRequestError("logit_bias values must be in [-100, 100] (OpenAI's range).", "logit_bias")
        if self.logit_bias:
            check_token_ids("logit_bias", list(self.logit_bias))
        if not is_int(self.min_tokens) or self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                                      f"{self.min_tokens!r}.", "min_tokens")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids (an empty one "
                                          "would allow nothing).", "allowed_token_ids")
            check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None and any(not isinstance(w, str) or not w for w in self.bad_words):
            raise InvalidRequestError("bad_words must be a list of non-empty strings.", "bad_words")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (how many of the most "
                                          f"likely tokens to return besides the chosen one), got {value!r}.", name)

    @property
    def greedy(self) -> bool:
        """Temperatures this close to 0 are greedy (as in vLLM): dividing logits by them overflows."""
        return self.temperature < GREEDY_BELOW


GREEDY_BELOW = 1e-5
# vLLM asks only > 0, but a logit divided by 1e-300 overflows to inf and sampling then fails (a 500): the floor
# mirrors the ceiling, 1/100, which keeps every penalised logit finite.
MIN_REPETITION_PENALTY = 0.01
MAX_LOGPROBS = 20               # vLLM's default max_logprobs: the most alternatives a request may ask for


@dataclass(eq=False)
class Request:
    """Mutable state of one request inside the engine (plain data; the scheduler and cache act on it).

    Compared by identity (``eq=False``): finding one in a queue must not compare every field of every
    request it passes, token lists included."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_index: int                  # global arrival order: FCFS and preemption use it
    arrival_time: float
    prompt: Optional[str] = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1         # prompt tokens served from the prefix cache at first admission (-1: not yet)
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: Optional[str | int] = None   # the EOS / stop token id or the stop string that ended it
    num_preemptions: int = 0
    first_scheduled_time: Optional[float] = None
    sample_index: int = 0               # which of the n parallel samples this is
    parent_id: Optional[str] = None     # the id the user sees when n > 1
    error: Optional[str] = None         # why it was aborted, when something failed while serving it (the client sees it)
    # Speculative decoding: guesses of the next tokens, made after the last step, for the next one to
    # check. They are not the request's tokens (num_tokens leaves them out) until the target accepts them.
    spec_token_ids: list[int] = field(default_factory=list)
    # The automatic k (speculative_config auto_k): drafts allowed in its next step, and its acceptance estimate.
    spec_k: Optional[int] = None
    spec_acceptance: Optional[float] = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens ``start:end`` of prompt + output, without building the whole list (a decode needs one)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_prefill(self) -> bool:
        """True while tokens we already know (prompt, or generated tokens after a recompute) lack KV."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


def fail_request(req: Request, message: str) -> None:
    """Mark one request failed while it is served (a logits processor, the sampler or a policy raised about
    it): the engine aborts it when the step's tokens are counted, its client gets ``message``, the others go on."""
    logger.error("request %s failed and is aborted (the others go on): %s", req.request_id, message)
    if req.error is None:
        req.error = message
