"""The OpenAI shapes: request bodies as pydantic models, and the JSON the server sends back.

Field names and defaults follow OpenAI's API and vLLM's ``entrypoints/openai/protocol.py`` (``top_k`` and
``ignore_eos`` are vLLM's extras), so any OpenAI client talks to ``minipaged serve`` unchanged. Every field a
body may carry is one of three kinds: honoured (a field of the models below), without effect on the answer
(``NO_EFFECT``: accounting and routing hints), or refused with a 400 naming it (``REFUSED``, one line per
field, and any field nobody knows). A client that asked for JSON output and got prose without an error
would be worse off than one told "no". The server's limits (``ServerLimits``) bound the work one request
can ask for; each refusal names the limit and the flag that sets it. Log-probabilities are the raw model's
(before penalties, biases, masks and temperature), as vLLM returns them by default.

This module stays free of torch: it only turns JSON into ``SamplingParams`` and outputs into JSON.
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..outputs import PositionLogprobs
from ..request import MAX_LOGPROBS, SamplingParams
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
    "best_of": Refusal("minipaged returns every sample it makes: ask for n samples instead", (None, 1)),
    "suffix": Refusal("minipaged does not insert text before a suffix", (None, "")),
    "min_p": Refusal("minipaged samples with temperature, top_k and top_p only", (None, 0, 0.0)),
    "guided_json": Refusal("vLLM's old guided_* fields are gone: use structured_outputs or response_format"),
    "guided_regex": Refusal("vLLM's old guided_* fields are gone: use structured_outputs or response_format"),
    "guided_choice": Refusal("vLLM's old guided_* fields are gone: use structured_outputs or response_format"),
    "guided_grammar": Refusal("vLLM's old guided_* fields are gone: use structured_outputs or response_format"),
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
    "return_hidden_states": Refusal("minipaged does not return hidden states", (None, False)),   # sglang-router
}
# Accepted and without effect on the answer: OpenAI uses them for accounting, storage or routing.
NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                       "prompt_cache_retention", "prompt_cache_options", "parallel_tool_calls",
                       # sglang-router adds these to every body it forwards: they split a reasoning model's
                       # thinking from its answer, and minipaged serves no reasoning model.
                       "separate_reasoning", "stream_reasoning"})


class ServerError(Exception):
    """An error the client caused (or may retry): becomes ``{"error": {...}}`` with this status code."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
             405: "MethodNotAllowedError", 413: "RequestTooLargeError", 429: "RateLimitError",
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
    priority: int = 0                  # vLLM's extension (extra_body): lower is admitted first under priority
    # Added by sglang-router to every body it forwards (SGLang's names), and honoured:
    skip_special_tokens: bool = True   # also vLLM's: False keeps special tokens (e.g. <|im_end|>) in the text
    no_stop_trim: bool = False         # vLLM's include_stop_str_in_output: the stop string stays in the text
    continue_final_message: bool = False   # chat (vLLM's too): continue the last assistant message, not a new one

    def refuse_unsupported(self, limits: ServerLimits = ServerLimits()) -> None:
        """A 400 for the first field the server cannot honour, or a value beyond its limits."""
        self.check_logprobs()
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
        self._check_logits_sizes(limits)

    def _check_logits_sizes(self, limits: ServerLimits) -> None:
        """The logits stage's tables and grammars: each bounded before the request is queued, so that building
        them (on arrival) and consulting them (every step) stays cheap for everyone else."""
        for name in ("stop_token_ids", "logit_bias"):
            self._check_limit(name, len(getattr(self, name) or ()), limits.max_token_ids, "max_token_ids",
                              "token ids")
        self._check_limit("allowed_token_ids", len(self.allowed_token_ids or ()), limits.max_allowed_token_ids,
                          "max_allowed_token_ids", "token ids")
        self._check_limit("bad_words", len(self.bad_words or ()), limits.max_bad_words, "max_bad_words", "bad words")
        self._check_limit("bad_words", max(map(len, self.bad_words or ()), default=0), limits.max_word_length,
                          "max_word_length", "characters in a bad word")
        so = self.structured_outputs if isinstance(self.structured_outputs, dict) else {}
        choice = so.get("choice")
        if isinstance(choice, list):
            self._check_limit("structured_outputs.choice", len(choice), limits.max_choices, "max_choices", "choices")
            self._check_limit("structured_outputs.choice", max((len(c) for c in choice if isinstance(c, str)),
                                                               default=0),
                              limits.max_word_length, "max_word_length", "characters in a choice")
        for key in ("json", "regex", "grammar"):
            self._check_grammar_size(f"structured_outputs.{key}", so.get(key), limits)
        if isinstance(self.response_format, dict):
            self._check_grammar_size("response_format", self.response_format.get("json_schema"), limits)

    def _check_grammar_size(self, param: str, value: Any, limits: ServerLimits) -> None:
        if value is None:
            return
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        self._check_limit(param, len(text.encode("utf-8", "surrogatepass")), limits.max_grammar_bytes,
                          "max_grammar_bytes", "bytes of grammar")

    def check_prompt_logprobs(self, params: SamplingParams, num_prompt_tokens: int, limits: ServerLimits) -> None:
        """Scoring a prompt costs its tokens x (top N + 1) entries, each decoded into the response."""
        if params.prompt_logprobs is not None:
            self._check_limit("prompt_logprobs", num_prompt_tokens * (params.prompt_logprobs + 1),
                              limits.max_prompt_logprobs, "max_prompt_logprobs",
                              "prompt log-probability entries (prompt tokens x (prompt_logprobs + 1))")

    def check_output_logprobs(self, params: SamplingParams, limits: ServerLimits) -> None:
        """The output's log-probabilities: n x max_tokens x (top N + 1) entries, each decoded into text in the
        engine core, kept there for the whole request and sent again with its last delta (its output), so they
        cost the server's memory whoever reads them and however fast (n=128 x 300 tokens x 21: +660 MB)."""
        if params.logprobs is not None:
            entries = params.n * params.max_tokens * (params.logprobs + 1)
            self._check_limit("logprobs", entries, limits.max_output_logprobs, "max_output_logprobs",
                              "output log-probability entries (n x max_tokens x (logprobs + 1))")

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
                              stop=self.stop or (), ignore_eos=self.ignore_eos, priority=self.priority,
                              skip_special_tokens=self.skip_special_tokens,
                              include_stop_str_in_output=self.no_stop_trim,
                              output_kind="delta" if self.stream else "cumulative", **self.logits_params())

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

    @field_validator("logprobs")
    @classmethod
    def false_asks_for_nothing(cls, value: Any) -> Any:
        """``logprobs: false`` (some clients send it) asks for nothing; ``0`` asks for the chosen tokens' only."""
        return None if value is False else value

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompts (text or token ids): one, or a list of them; choice ``i * n + j`` is prompt i's sample j."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]

    def refuse_unsupported(self, limits: ServerLimits = ServerLimits()) -> None:
        if self.continue_final_message:
            raise ServerError(400, "continue_final_message is a chat option (it continues the last assistant "
                                   "message); a completions prompt is continued as it is: leave it unset.",
                              "continue_final_message")
        super().refuse_unsupported(limits)
        self._check_limit("prompt", len(self.prompts()), limits.max_prompts, "max_prompts", "prompts")

    def num_samples(self) -> int:
        return self.n * len(self.prompts())


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


class PagePrompt(BaseModel):
    """What the page's prompt box sends to ``POST /v1/page/prompt``: a text and at most two knobs, each capped by
    the teacher (``teacher.PageControls``). Nothing else: the OpenAI routes are there for everything else."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0)
    stream: bool = False      # OpenAI's default: a script that leaves it out gets one JSON body; the page asks


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

    def refuse_unsupported(self, limits: ServerLimits = ServerLimits()) -> None:
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise ServerError(400, f"messages[{i}].role is {message.role!r}; a message's role is one of "
                                       f"{', '.join(CHAT_ROLES)}.", f"messages[{i}].role")
        super().refuse_unsupported(limits)


# ----------------------------------------------------------------------------------------- the tokenizer routes
# vLLM's fields beyond these ask for what minipaged does not do; refused by name, like REFUSED above.
TOKENIZE_REFUSED: dict[str, Refusal] = {
    "chat_template": Refusal("a template sent with the request is code the server would run (vLLM refuses it "
                             "too, unless started with --trust-request-chat-template); the model's own is used"),
    "chat_template_kwargs": Refusal("the chat route takes no template arguments either, so tokens counted with "
                                    "them would not be the tokens a chat request gets", (None, {})),
    "tools": Refusal("minipaged does not call tools", (None, [])),
    "mm_processor_kwargs": Refusal("minipaged serves text only", (None, {})),
}
CHAT_ONLY = ("add_generation_prompt", "continue_final_message")


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` and ``TokenizeChatRequest`` in one body: ``prompt`` (text) or
    ``messages`` (a chat, through the model's template). One model, not pydantic's union of two, so a body with
    both, or neither, gets a 400 that says so instead of being read as whichever matched first."""

    model_config = ConfigDict(extra="allow")      # kept, to refuse them by name

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: Optional[bool] = None     # vLLM's defaults differ: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: Optional[bool] = False

    def refuse_unsupported(self) -> None:
        """A 400 for a body that is not one of vLLM's two shapes, or asks for what minipaged cannot honour."""
        for name, value in (self.model_extra or {}).items():
            refusal = TOKENIZE_REFUSED.get(name)
            if refusal is None:
                raise ServerError(400, f"Unrecognized request argument supplied: {name} (/tokenize takes model, "
                                       f"prompt or messages, add_special_tokens, add_generation_prompt, "
                                       f"continue_final_message, return_token_strs; leave it out).", name)
            if refusal.refuses(value):
                raise ServerError(400, f"{name} is not supported: {refusal.why}; leave {name} out of the "
                                       f"request.", name)
        if (self.prompt is None) == (self.messages is None):
            which = "both" if self.prompt is not None else "neither"
            raise ServerError(400, f"/tokenize takes prompt (a text) or messages (a chat), and this body has "
                                   f"{which}: send exactly one of them.", "prompt")
        if self.messages is None:
            for name in CHAT_ONLY:
                if name in self.model_fields_set:
                    raise ServerError(400, f"{name} is a chat option (for messages); a prompt is tokenized as it "
                                           f"is: leave {name} out.", name)
        else:
            if not self.messages:
                raise ServerError(400, "messages is empty: send at least one message.", "messages")
            for i, message in enumerate(self.messages):
                if message.role not in CHAT_ROLES:
                    raise ServerError(400, f"messages[{i}].role is {message.role!r}; a message's role is one of "
                                           f"{', '.join(CHAT_ROLES)}.", f"messages[{i}].role")
            if self.continue_final_message and self.add_generation_prompt:
                # vLLM's rule: an open last message and a new assistant turn contradict each other
                raise ServerError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to "
                                       "True: set add_generation_prompt to false to continue the last message.",
                                  "continue_final_message")
        for path in bad_unicode(self.model_dump(include={"prompt", "messages"}), ""):
            raise ServerError(400, f"{path} is not valid Unicode text (a lone surrogate such as \\ud800?): send "
                                   f"UTF-8 text.", path)

    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.messages is None


class DetokenizeRequest(BaseModel):
    """vLLM's ``DetokenizeRequest``: token ids back to text (``DetokenizeResponse``: ``{"prompt": text}``)."""

    model_config = ConfigDict(extra="forbid")     # pydantic names the unknown field in its 400

    model: Optional[str] = None
    tokens: list[int]


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
