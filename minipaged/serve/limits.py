"""What one request may ask of ``minipaged serve`` (``ServerLimits``) and how the server behaves
(``ServerSettings``): each value's default, spelled here once, which the flags show and the app uses.

Plain data without pydantic or FastAPI, so that building the CLI parser does not import them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional

WATCHER_BUFFER_BYTES = 4 << 20        # unsent bytes a watcher may hold before it is dropped (~2,000 steps)


def limit(default: int, help_text: str) -> Any:
    """One request limit: its default and its flag's help, spelled once (the flag is the name with dashes)."""
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True)
class ServerLimits:
    """What one request (or connection, or client) may ask for. Each field is a ``minipaged serve`` flag of the
    same name with dashes (``max_n`` -> ``--max-n``), its help the field's, which a refusal names (``flag``)."""

    # samples per request (vLLM-like servers cap n near this)
    max_n: int = limit(128, "the most samples (n) one request may ask for")
    max_prompts: int = limit(64, "the most prompts one completions request may carry")
    # OpenAI allows 4; each one is searched for after every token
    max_stop_strings: int = limit(16, "the most stop strings one request may give")
    # a stream holds back this many characters minus one
    max_stop_length: int = limit(256, "the longest stop string, in characters")
    # a 128k-token prompt as JSON token ids is under 1 MiB
    max_body_bytes: int = limit(8 * 2**20, "the largest request body; larger ones get 413")
    # The logits stage's inputs: each is a table built once per request and consulted every step.
    # (OpenAI caps logit_bias at 300)
    max_token_ids: int = limit(1024, "the most entries in stop_token_ids, and in logit_bias")
    # a whole vocabulary (SmolLM2: 49,152) fits
    max_allowed_token_ids: int = limit(1 << 17, "the most entries in allowed_token_ids")
    # each is tokenised twice (as written, with a space) when it arrives
    max_bad_words: int = limit(256, "the most bad_words one request may give")
    # structured outputs' choice: compiling costs ~1 ms a choice on SmolLM2 (how long it may take: the engine
    # option --grammar-timeout)
    max_choices: int = limit(1024, "the most choices in structured_outputs.choice")
    max_word_length: int = limit(256, "the longest bad word or choice, in characters")
    max_grammar_bytes: int = limit(65536, "the largest JSON schema (as JSON text), regex or grammar, in bytes")
    # Prompt log-probabilities: prompt tokens x (top N + 1) entries, each decoded into text in the engine core
    # (the LM head over the prompt's rows costs like prefill, and is chunked with it).
    # A paused reader's output waits in the API server; without a bound it grew by ~50 MB of log-probabilities.
    max_stream_backlog: int = limit(1 << 17, "the most generated tokens (each log-probability entry counts one "
                                             "more) one stream's reader may leave unread; past it the request is "
                                             "aborted with an error (the engine never waits for a reader)")
    # A request that is not streamed gets its output's log-probabilities in one answer, kept in the core until
    # its end (a stream's go out step by step: output_kind="delta"): n=128 x 300 tokens with logprobs=20 (806,400
    # entries) grew the server by ~660 MB at its peak, when streams' were kept and sent again as well.
    max_output_logprobs: int = limit(1 << 17, "the most output log-probability entries one request may ask for: "
                                              "n x max_tokens x (logprobs + 1) (with top_logprobs on chat)")
    max_prompt_logprobs: int = limit(16_384, "the most prompt log-probability entries one prompt may ask for: "
                                             "prompt tokens x (prompt_logprobs + 1), echo with logprobs included")

    # Connections and event streams (connections.py, event_hub.StreamLimits): what one client, or all of them,
    # may hold open. An adversarial review's 1,100 silent sockets used up 1,024 file descriptors.
    max_connections: int = limit(1024, "the most open connections; requests on more get 503 (/health still "
                                       "answers); lowered at start-up to what the file-descriptor limit allows")
    # A browser opens at most 6 connections to one server, a script one per request in flight: 32 each for a
    # class of 30 is the 1,024 above shared out, and one client's sockets can no longer take them all.
    max_client_connections: int = limit(32, "the most open connections from one client (address); more are "
                                            "refused with 429 as they open, before their request is read (this "
                                            "machine: no bound)")
    header_timeout: int = limit(10, "seconds a connection may take to send a request's line and headers (from "
                                    "opening, or from its last answer) before it is closed")
    max_event_streams: int = limit(128, "the most /v1/events streams open at once (at most half of "
                                        "--max-connections); more get 503")
    max_client_event_streams: int = limit(4, "the most /v1/events streams one client (address) may hold open; "
                                             "more get 429 (the API key's holder and this machine: no bound)")

    @staticmethod
    def flag(name: str) -> str:
        """The ``minipaged serve`` flag that sets limit ``name``."""
        return "--" + name.replace("_", "-")


def limit_names() -> list[str]:
    """Every limit, in the order of the flags."""
    return [f.name for f in fields(ServerLimits)]


@dataclass(frozen=True)
class PageSettings:
    """The teacher's controls over what students do through the page (``serve``'s ``--page-*`` flags, and
    ``--hide-others-text``, ``--open-page``); ``teacher.py`` applies them. The OpenAI API keeps its own limits.

    The defaults are for a projector: a short answer (64 tokens, as the page always asked for), greedy unless the
    request asks for more randomness, and never more than 0.7 (a 135M model's sampled text at 1.0 wanders)."""

    prompts: bool = True                     # students may send prompts from the page (--page-prompts on|off)
    prompt_rate: Optional[int] = None        # page prompts per minute per client address (None: no bound)
    max_tokens: int = 64                     # the most new tokens a page prompt may ask for (and its default)
    max_temperature: float = 0.7             # the highest temperature a page prompt may ask for (default 0: greedy)
    hide_others_text: bool = False           # a student's page gets no other client's prompt or output text
    open_page: bool = False                  # with --api-key: the page's routes need no key (a class's students)


@dataclass(frozen=True)
class ServerSettings:
    """How one server runs (``minipaged serve``'s flags, or a test's ``build_app``)."""

    served_model_name: str
    api_key: Optional[str] = None
    max_waiting_requests: Optional[int] = 256   # samples waiting for admission before 503 (None: no bound)
    limits: ServerLimits = field(default_factory=ServerLimits)
    event_heartbeat_s: float = 5.0           # an SSE comment on /v1/events after this long without a line
    shutdown_timeout_s: float = 30.0         # SIGTERM: how long running requests may go on finishing
    engine_stall_s: float = 30.0             # /health says 503 when the engine core is silent this long
    event_buffer_bytes: int = WATCHER_BUFFER_BYTES   # a /v1/events watcher this far behind is dropped
    host: Optional[str] = None               # the address it listens on: which Host names it answers to (None:
                                             # an app built in-process, as tests do, checks no Host)
    allowed_hosts: tuple[str, ...] = ()      # more Host names (--allowed-hosts; "*": any)
    max_client_samples: Optional[int] = None         # per client (address) in the engine at once (None: no bound;
                                                     # the flag's default is half of max_waiting_requests)
    max_client_prompt_tokens: Optional[int] = 1 << 17    # per client in the engine at once: n=16 of an 8k prompt
    page: PageSettings = field(default_factory=PageSettings)   # the teacher's controls over the page


DEFAULTS = ServerSettings(served_model_name="")     # every default, for the flags
