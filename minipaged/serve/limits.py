"""What one request may ask of ``minipaged serve``: the limits, their defaults and the flags that set them.

Plain data without pydantic or FastAPI, so that building the CLI parser does not import them.
"""
from __future__ import annotations

from dataclasses import dataclass


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
