"""What a request may ask of the logits stage that is more than a number: structured outputs (vLLM's names).

Plain data, free of torch and of the grammar library: ``SamplingParams`` carries it, the server builds it
from JSON, and ``structured.StructuredOutputCompiler`` turns it into a grammar when the request is queued.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union


class StructuredOutputsError(ValueError):
    """A structured-outputs request that is malformed (several kinds at once, a bad schema, ...)."""


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
            raise StructuredOutputsError(
                f"structured outputs take exactly one of json, regex, choice, grammar or json_object; got "
                f"{given or 'none'}.")
        if self.choice is not None and (not self.choice or any(not isinstance(c, str) for c in self.choice)):
            raise StructuredOutputsError("structured outputs 'choice' must be a non-empty list of strings.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise StructuredOutputsError(f"structured outputs '{name}' must be a non-empty string.")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, n))

    def schema_text(self) -> str:
        """The JSON schema as text (a dict is dumped; text is checked to be JSON)."""
        if isinstance(self.json, str):
            try:
                json.loads(self.json)
            except ValueError as exc:
                raise StructuredOutputsError(f"the JSON schema is not valid JSON: {exc}") from None
            return self.json
        return json.dumps(self.json)

    @staticmethod
    def from_any(value: Any) -> Optional["StructuredOutputsParams"]:
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if isinstance(value, dict):
            return StructuredOutputsParams(**value)
        raise StructuredOutputsError("structured_outputs must be a StructuredOutputsParams or a dict of its fields.")
