"""The OpenAI shapes: request bodies as pydantic models, and the JSON the server sends back.

Field names and defaults follow OpenAI's API and vLLM's ``entrypoints/openai/protocol.py`` (``top_k`` and
``ignore_eos`` are vLLM's extras), so any OpenAI client talks to ``minipaged serve`` unchanged. Whatever
the engine cannot do is refused with a 400 that says so, rather than silently ignored. Log-probabilities
are the raw model's (before penalties, biases, masks and temperature), as vLLM returns them by default.

This module stays free of torch: it only turns JSON into ``SamplingParams`` and outputs into JSON.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..outputs import PositionLogprobs
from ..request import MAX_LOGPROBS, SamplingParams

OPENAI_DEFAULT_MAX_TOKENS = 16          # completions: OpenAI's (and vLLM's) default


class ServerError(Exception):
    """An error the client caused (or may retry): becomes ``{"error": {...}}`` with this status code."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error JSON; ``type`` is vLLM's spelling, ``code`` the HTTP status."""
    return {"error": {"message": message, "type": ServerError.TYPES.get(status, "Error"), "param": param,
                      "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stopping and streaming."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    logprobs: Optional[Any] = None
    echo: bool = False
    # The logits stage (OpenAI's penalties and logit_bias; the rest are vLLM's extras)
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    min_tokens: int = 0
    stop_token_ids: Optional[list[int]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    prompt_logprobs: Optional[int] = None
    return_tokens_as_token_ids: bool = False

    def refuse_unsupported(self) -> None:
        self.check_logprobs()
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed when stream is true.", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_logprobs(self) -> None:
        """Completions' ``logprobs`` is a count (0..20); chat overrides this (a flag plus ``top_logprobs``)."""
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ServerError(400, f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (how many alternatives to "
                                   f"return per token), got {self.logprobs!r}.", "logprobs")

    @property
    def num_logprobs(self) -> Optional[int]:
        return self.logprobs

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (it validates them; InvalidRequestError becomes a 400)."""
        return SamplingParams(n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=0 if self.top_k is None else self.top_k, seed=self.seed, max_tokens=max_tokens,
                              stop=self.stop or (), ignore_eos=self.ignore_eos, **self.logits_params())

    def logits_params(self) -> dict[str, Any]:
        """The SamplingParams fields of the logits stage and log-probabilities."""
        return dict(presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                    logit_bias=self.logit_bias, min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids or (),
                    allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                    structured_outputs=self.structured(), logprobs=self.num_logprobs,
                    prompt_logprobs=self.prompt_logprobs)

    def structured(self) -> Optional[dict[str, Any]]:
        """OpenAI's ``response_format`` or vLLM's ``structured_outputs``, as StructuredOutputsParams fields."""
        if self.response_format is not None and self.structured_outputs is not None:
            raise ServerError(400, "give either response_format or structured_outputs, not both.", "response_format")
        if self.structured_outputs is not None:
            return self.structured_outputs
        fmt = self.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"json_object": True}
        if fmt.get("type") == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise ServerError(400, "response_format json_schema needs {'json_schema': {'name': ..., 'schema': "
                                       "{...}}} with the schema as an object.", "response_format")
            return {"json": schema}
        raise ServerError(400, f"response_format type must be 'text', 'json_object' or 'json_schema', got "
                               f"{fmt.get('type')!r}.", "response_format")


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts (text or token ids): one, or a list of them; choice ``i * n + j`` is prompt i's sample j."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: Union[str, list[ContentPart], None] = None

    def as_template_dict(self) -> dict[str, str]:
        """The message as a chat template takes it: text parts joined, anything else refused."""
        if self.content is None or isinstance(self.content, str):
            return {"role": self.role, "content": self.content or ""}
        not_text = [part.type for part in self.content if part.type != "text"]
        if not_text:
            raise ServerError(400, f"message parts of type {not_text[0]!r} are not supported; send text only.",
                              "messages")
        return {"role": self.role, "content": "".join(part.text or "" for part in self.content)}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    top_logprobs: Optional[int] = None

    def check_logprobs(self) -> None:
        if self.echo:
            raise ServerError(400, "echo is a completions option; leave it unset for chat.", "echo")
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ServerError(400, f"chat logprobs must be true or false, got {self.logprobs!r}.", "logprobs")
        if self.top_logprobs is not None:
            if isinstance(self.top_logprobs, bool) or not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise ServerError(400, f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}, got "
                                       f"{self.top_logprobs!r}.", "top_logprobs")
            if not self.logprobs:
                raise ServerError(400, "top_logprobs needs logprobs set to true.", "top_logprobs")

    @property
    def num_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None


# ----------------------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: Optional[str],
                      stop_reason: Union[str, int, None] = None, logprobs: Optional[dict] = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str, finish_reason: Optional[str],
                stop_reason: Union[str, int, None] = None, logprobs: Optional[dict] = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk_choice(index: int, delta: dict[str, str], finish_reason: Optional[str],
                      logprobs: Optional[dict] = None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


# ----------------------------------------------------------------------------------------- log-probabilities
# A position is (token id, vLLM's {token id: Logprob} with the top N first); None: nothing came before it.
Position = tuple[int, Optional[PositionLogprobs]]


def token_text(token_id: int, position: Optional[PositionLogprobs], as_ids: bool) -> str:
    """A token as the response names it: its text, or vLLM's ``token_id:N`` (return_tokens_as_token_ids)."""
    if as_ids:
        return f"token_id:{token_id}"
    entry = position.get(token_id) if position else None
    return entry.decoded_token if entry is not None and entry.decoded_token is not None else ""


def completion_logprobs(positions: list[Position], num_top: int, as_ids: bool, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions shape: tokens, token_logprobs, top_logprobs (the top N and the chosen token), offsets."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in positions:
        text = token_text(token_id, position, as_ids)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
        if position is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(position[token_id].logprob)
        top = [t for t in list(position)[:num_top]] + ([] if token_id in list(position)[:num_top] else [token_id])
        out["top_logprobs"].append({token_text(t, position, as_ids): position[t].logprob for t in top})
    return out


def chat_logprobs(positions: list[Position], num_top: int, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""
    def entry(token_id: int, position: PositionLogprobs) -> dict[str, Any]:
        text = token_text(token_id, position, as_ids)
        return {"token": text, "logprob": position[token_id].logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(token_id, position),
                         "top_logprobs": [entry(t, position) for t in list(position)[:num_top]]}
                        for token_id, position in positions if position is not None]}


def prompt_logprobs_json(positions: Optional[list[Optional[PositionLogprobs]]],
                         as_ids: bool) -> Optional[list[Optional[dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs`` field: per prompt token, {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if pos is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                               "decoded_token": token_text(t, pos, as_ids)} for t, lp in pos.items()}
            for pos in positions]


Kind = Literal["completion", "chat"]
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
