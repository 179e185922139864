"""The OpenAI shapes: request bodies as pydantic models, and the JSON the server sends back.

Field names and defaults follow OpenAI's API and vLLM's ``entrypoints/openai/protocol.py`` (``top_k`` and
``ignore_eos`` are vLLM's extras), so any OpenAI client talks to ``minipaged serve`` unchanged. Every field a
body may carry is one of three kinds: honoured (a field of the models below), without effect on the answer
(``NO_EFFECT``: accounting and routing hints), or refused with a 400 naming it (``REFUSED``, one line per
field, and any field nobody knows). A client that asked for JSON output and got prose without an error
would be worse off than one told "no". The server's limits (``ServerLimits``) bound the work one request
can ask for; each refusal names the limit and the flag that sets it.

This module stays free of torch: it only turns JSON into ``SamplingParams`` and outputs into JSON.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from ..request import SamplingParams
from .limits import ServerLimits

OPENAI_DEFAULT_MAX_TOKENS = 16          # completions: OpenAI's (and vLLM's) default
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Refusal:
    """Why a field is refused, and the values that ask for nothing (accepted). Values are compared with their
    type, so ``logprobs: 0`` (0 == False in Python) is a request for log-probabilities, not a no."""

    why: str
    harmless: tuple = (None,)

    def refuses(self, value: Any) -> bool:
        return not any(type(value) is type(h) and value == h for h in self.harmless)


# Fields of OpenAI's (or vLLM's) request bodies that minipaged cannot honour yet. Honouring one is deleting its
# line here and giving the model below a field for it.
REFUSED: dict[str, Refusal] = {
    "logprobs": Refusal("minipaged does not return log-probabilities", (None, False)),
    "top_logprobs": Refusal("minipaged does not return log-probabilities"),
    "prompt_logprobs": Refusal("minipaged does not return log-probabilities"),
    "echo": Refusal("minipaged does not echo the prompt back", (None, False)),
    "best_of": Refusal("minipaged returns every sample it makes: ask for n samples instead", (None, 1)),
    "suffix": Refusal("minipaged does not insert text before a suffix", (None, "")),
    "presence_penalty": Refusal("minipaged applies no penalties", (None, 0, 0.0)),
    "frequency_penalty": Refusal("minipaged applies no penalties", (None, 0, 0.0)),
    "repetition_penalty": Refusal("minipaged applies no penalties", (None, 1, 1.0)),
    "logit_bias": Refusal("minipaged does not bias logits", (None, {})),
    "min_tokens": Refusal("minipaged has no minimum output length", (None, 0)),
    "min_p": Refusal("minipaged samples with temperature, top_k and top_p only", (None, 0, 0.0)),
    "stop_token_ids": Refusal("the server does not pass stop token ids to the engine yet", (None, [])),
    "response_format": Refusal("minipaged has no structured (JSON) output", (None, {"type": "text"})),
    "guided_json": Refusal("minipaged has no structured (JSON) output"),
    "guided_regex": Refusal("minipaged has no structured output"),
    "guided_choice": Refusal("minipaged has no structured output"),
    "guided_grammar": Refusal("minipaged has no structured output"),
    "structured_outputs": Refusal("minipaged has no structured output"),
    "tools": Refusal("minipaged does not call tools", (None, [])),
    "tool_choice": Refusal("minipaged does not call tools", (None, "none")),
    "functions": Refusal("minipaged does not call functions", (None, [])),
    "function_call": Refusal("minipaged does not call functions", (None, "none")),
    "audio": Refusal("minipaged answers in text only"),
    "modalities": Refusal("minipaged answers in text only", (None, ["text"])),
    "prediction": Refusal("minipaged has no predicted outputs"),
    "web_search_options": Refusal("minipaged does not search the web"),
    "reasoning_effort": Refusal("minipaged serves no reasoning model"),
    "verbosity": Refusal("minipaged has no verbosity setting"),
    "moderation": Refusal("minipaged does not moderate"),
    "use_beam_search": Refusal("minipaged does not search beams", (None, False)),
}
# Accepted and without effect on the answer: OpenAI uses them for accounting, storage or routing.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_retention", "prompt_cache_options", "parallel_tool_calls"})


class ServerError(Exception):
    """An error the client caused (or may retry): becomes ``{"error": {...}}`` with this status code."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
             413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

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


def bad_unicode(value: Any, path: str) -> Iterator[str]:
    """The paths of strings in ``value`` that are not valid Unicode (a lone surrogate such as "\\ud800" is
    valid JSON but no text: the tokenizer cannot encode it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            yield path
    elif isinstance(value, list) and not (value and isinstance(value[0], int)):    # token ids hold no text
        for i, item in enumerate(value):
            yield from bad_unicode(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from bad_unicode(item, f"{path}.{key}" if path else str(key))


class SamplingFields(BaseModel):
    """What completions and chat share: sampling, stopping and streaming."""

    model_config = ConfigDict(extra="allow")      # kept, to refuse them by name (see REFUSED)

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

    def refuse_unsupported(self, limits: ServerLimits = ServerLimits()) -> None:
        """A 400 for the first field the server cannot honour, or a value beyond its limits."""
        sent = {**{name: getattr(self, name) for name in self.model_fields_set}, **(self.model_extra or {})}
        for name, value in sent.items():
            refusal = REFUSED.get(name)
            if refusal is not None and refusal.refuses(value):
                raise ServerError(400, f"{name} is not supported: {refusal.why}; leave {name} out of the request.",
                                  name)
            if refusal is None and name not in type(self).model_fields and name not in NO_EFFECT:
                raise ServerError(400, f"Unrecognized request argument supplied: {name} (minipaged neither "
                                       f"honours nor knows it; leave it out).", name)
        for path in bad_unicode(self.model_dump(include=set(type(self).model_fields)), ""):
            raise ServerError(400, f"{path} is not valid Unicode text (a lone surrogate such as \\ud800?): send "
                                   f"UTF-8 text.", path)
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed when stream is true.", "stream_options")
        self._check_limit("n", self.n, limits.max_n, "max_n", "samples per request")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        self._check_limit("stop", len(stops), limits.max_stop_strings, "max_stop_strings", "stop strings")
        longest = max((len(s) for s in stops), default=0)
        self._check_limit("stop", longest, limits.max_stop_length, "max_stop_length",
                          "characters in a stop string")

    @staticmethod
    def _check_limit(param: str, value: Any, limit: int, name: str, what: str) -> None:
        if isinstance(value, int) and value > limit:
            raise ServerError(400, f"too many {what} in {param}: {value}, this server's limit is {limit} "
                                   f"(minipaged serve {ServerLimits.flag(name)}).", param)

    def num_samples(self) -> int:
        """How many sequences the request puts in the queue (what admission counts)."""
        return self.n

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's SamplingParams (it validates them; InvalidRequestError becomes a 400)."""
        return SamplingParams(n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p,
                              top_k=0 if self.top_k is None else self.top_k, seed=self.seed, max_tokens=max_tokens,
                              stop=self.stop or (), ignore_eos=self.ignore_eos)


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def refuse_unsupported(self, limits: ServerLimits = ServerLimits()) -> None:
        super().refuse_unsupported(limits)
        self._check_limit("prompt", len(self.prompts()), limits.max_prompts, "max_prompts", "prompts")

    def num_samples(self) -> int:
        return self.n * len(self.prompts())

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

    def refuse_unsupported(self, limits: ServerLimits = ServerLimits()) -> None:
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise ServerError(400, f"messages[{i}].role is {message.role!r}; a message's role is one of "
                                       f"{', '.join(CHAT_ROLES)}.", f"messages[{i}].role")
        super().refuse_unsupported(limits)


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
