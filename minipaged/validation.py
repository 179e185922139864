"""The checks every options class shares: the engine's (``config``), a request's (``request``) and speculative
decoding's (``spec_decode.config``).

They live below all three so that each can import them without importing the others: ``config`` reads
``spec_decode.config`` to parse ``speculative_config``, so that module cannot import ``config`` back.
"""
from __future__ import annotations


def is_int(value: object) -> bool:
    """An integer that is not a bool (True would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ConfigError(ValueError):
    """An engine option has a value the engine cannot work with; the message names the fix."""
