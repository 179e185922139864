"""What one request may ask of ``minipaged serve`` (``ServerLimits``) and how the server behaves
(``ServerSettings``): each value's default, spelled here once, which the flags show and the app uses.

Plain data without pydantic or FastAPI, so that building the CLI parser does not import them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

WATCHER_BUFFER_BYTES = 4 << 20        # unsent bytes a watcher may hold before it is dropped (~2,000 steps)


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask for; each has a ``minipaged serve`` flag (``flag``) that the refusal names."""

    max_n: int = 128                    # samples per request (vLLM-like servers cap n near this)
    max_prompts: int = 64               # prompts in one completions request
    max_stop_strings: int = 16          # OpenAI allows 4; each one is searched for after every token
    max_stop_length: int = 256          # characters; a stream holds back this many minus one
    max_body_bytes: int = 8 * 2**20     # a 128k-token prompt as JSON token ids is under 1 MiB

    FLAGS = {"max_n": "--max-n", "max_prompts": "--max-prompts", "max_stop_strings": "--max-stop-strings",
             "max_stop_length": "--max-stop-length", "max_body_bytes": "--max-body-bytes"}

    @staticmethod
    def flag(name: str) -> str:
        return ServerLimits.FLAGS[name]


@dataclass(frozen=True)
class ServerSettings:
    """How one server runs (``minipaged serve``'s flags, or a test's ``build_app``)."""

    served_model_name: str
    api_key: Optional[str] = None
    max_waiting_requests: Optional[int] = 256   # samples waiting for admission before 503 (None: no bound)
    limits: ServerLimits = field(default_factory=ServerLimits)
    event_heartbeat_s: float = 5.0           # an SSE comment on /v1/events after this long without a line
    shutdown_timeout_s: float = 30.0         # SIGTERM: how long running requests may go on finishing
    engine_stall_s: float = 30.0             # /health says 503 when the engine thread is silent this long
    event_buffer_bytes: int = WATCHER_BUFFER_BYTES   # a /v1/events watcher this far behind is dropped
    host: Optional[str] = None               # the address it listens on: which Host names it answers to (None:
                                             # an app built in-process, as tests do, checks no Host)
    allowed_hosts: tuple[str, ...] = ()      # more Host names (--allowed-hosts; "*": any)
    max_client_samples: Optional[int] = None         # per client (address) in the engine at once (None: no bound;
                                                     # the flag's default is half of max_waiting_requests)
    max_client_prompt_tokens: Optional[int] = 1 << 17    # per client in the engine at once: n=16 of an 8k prompt


DEFAULTS = ServerSettings(served_model_name="")     # every default, for the flags
