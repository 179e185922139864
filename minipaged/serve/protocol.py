"""The OpenAI shapes: request bodies as pydantic models, and the JSON the server sends back.

Field names and defaults follow OpenAI's API and vLLM's ``entrypoints/openai/protocol.py`` (``top_k`` and
``ignore_eos`` are vLLM's extras), so any OpenAI client talks to ``minipaged serve`` unchanged. Whatever
the engine cannot do (logprobs, echo, several prompts in one request) is refused with a 400 that says so,
rather than silently ignored.

This module stays free of torch: it only turns JSON into ``SamplingParams`` and outputs into JSON.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..request import SamplingParams

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
    priority: int = 0                  # vLLM's extension (extra_body): lower is admitted first under priority
    logprobs: Optional[Any] = None
    echo: bool = False

    def refuse_unsupported(self) -> None:
        if self.logprobs not in (None, False):
            raise ServerError(400, "logprobs are not supported by minipaged; leave logprobs unset.", "logprobs")
        if self.echo:
            raise ServerError(400, "echo is not supported by minipaged; leave echo unset.", "echo")
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed when stream is true.", "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (it validates them; InvalidRequestError becomes a 400)."""
        return SamplingParams(n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=0 if self.top_k is None else self.top_k, seed=self.seed, max_tokens=max_tokens,
                              stop=self.stop or (), ignore_eos=self.ignore_eos, priority=self.priority)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt (text or token ids); a list of one prompt is accepted, as OpenAI allows it."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ServerError(400, f"got {len(p)} prompts in one request; minipaged takes one prompt per "
                                       f"request: send them as separate (concurrent) requests.", "prompt")
            p = p[0]
        return p


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


# ----------------------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now_s() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: Optional[str],
                      stop_reason: Union[str, int, None] = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str, finish_reason: Optional[str],
                stop_reason: Union[str, int, None] = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_chunk_choice(index: int, delta: dict[str, str], finish_reason: Optional[str]) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


Kind = Literal["completion", "chat"]
OBJECT = {"completion": "text_completion", "chat": "chat.completion"}
CHUNK_OBJECT = {"completion": "text_completion", "chat": "chat.completion.chunk"}
ID_PREFIX = {"completion": "cmpl", "chat": "chatcmpl"}
