"""What to speculate with, checked before anything loads (vLLM's ``speculative_config`` names).

    Engine("smollm2", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    Engine("smollm2", speculative_config={"method": "draft_model", "model": "self", "num_draft_layers": 8,
                                          "num_speculative_tokens": 3})
    Engine("smollm2", speculative_config={"method": "int8_self_draft", "num_speculative_tokens": 3,
                                          "auto_k": True})

This module stays free of torch: the command line and thin clients validate with it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional, Union

from ..validation import ConfigError, is_int

INT8_SELF_DRAFT = "int8_self_draft"   # the target's own weights in int8 (kernels/int8.py) draft for it
METHODS = ("ngram", "draft_model", INT8_SELF_DRAFT)
SELF_DRAFT = "self"          # the draft is the target's own first layers + its final norm and LM head
# vLLM's defaults when neither lookup bound is given (vllm/config/speculative.py).
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: Optional[int] = None   # ngram: shortest suffix n-gram that may match
    prompt_lookup_max: Optional[int] = None   # ngram: longest one, tried first
    model: Optional[str] = None               # draft_model: a Llama checkpoint with the same vocabulary, or "self"
    num_draft_layers: Optional[int] = None    # draft_model "self": how many of the target's layers draft (all)
    # minipaged's own: num_speculative_tokens becomes the most a request drafts, and each step each request gets
    # the k that its acceptance and the step's measured cost say pays (0: none); see auto_k.py
    auto_k: bool = False

    @staticmethod
    def parse(value: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """Accept a dict, a JSON string (``--speculative-config '{"method": "ngram", ...}'``) or None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not valid JSON ({exc}); example: "
                                  '\'{"method": "ngram", "num_speculative_tokens": 3}\'') from None
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict, got {value!r}.")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s) {unknown}; valid keys: {sorted(known)}.")
        d = dict(value)
        if "method" not in d:                       # vLLM infers the method from a model name
            d["method"] = "draft_model" if d.get("model") else None
        if "num_speculative_tokens" not in d:
            raise ConfigError("speculative_config needs num_speculative_tokens (how many tokens to draft per "
                              "step), e.g. 3.")
        config = SpeculativeConfig(**d)
        config.validate()
        return config.with_defaults()

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r}; use one of {list(METHODS)} "
                              "(draft_model needs a model: another Llama checkpoint with the same vocabulary, "
                              f"or 'self' with num_draft_layers; {INT8_SELF_DRAFT} needs nothing more).")
        if not is_int(self.num_speculative_tokens) or self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}.")
        if not isinstance(self.auto_k, bool):
            raise ConfigError(f"auto_k must be true or false, got {self.auto_k!r}.")
        if self.method == "ngram":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                value = getattr(self, name)
                if value is not None and (not is_int(value) or value < 1):
                    raise ConfigError(f"{name} must be an integer >= 1, got {value!r}.")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is not None and hi is not None and lo > hi:
                raise ConfigError(f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi}).")
            if self.model is not None or self.num_draft_layers is not None:
                raise ConfigError("method 'ngram' drafts from the text itself; model and num_draft_layers belong "
                                  "to method 'draft_model'.")
        elif self.method == INT8_SELF_DRAFT:
            for name in ("model", "num_draft_layers", "prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"method '{INT8_SELF_DRAFT}' drafts with the target's own weights in int8: "
                                      f"{name} does not apply (leave it out).")
        else:
            if not self.model or not isinstance(self.model, str):
                raise ConfigError("method 'draft_model' needs model: a Llama checkpoint with the target's "
                                  "vocabulary, or 'self' (the target's first num_draft_layers layers).")
            if self.model == SELF_DRAFT:
                # None: every layer. The draft is then the target itself: every guess is right, which shows
                # the mechanics (lesson 6) but drafting costs as much as the target, so it is never faster.
                if self.num_draft_layers is not None and (not is_int(self.num_draft_layers)
                                                          or self.num_draft_layers < 1):
                    raise ConfigError("a self-draft's num_draft_layers must be an integer >= 1 (how many of the "
                                      f"target's layers draft), got {self.num_draft_layers!r}.")
            elif self.num_draft_layers is not None:
                raise ConfigError("num_draft_layers only applies to the self-draft (model 'self').")
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ConfigError("prompt_lookup_min/max belong to method 'ngram'.")

    def with_defaults(self) -> "SpeculativeConfig":
        """vLLM's rule: neither bound given -> both 5; one given -> the other equals it."""
        if self.method != "ngram":
            return self
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = DEFAULT_PROMPT_LOOKUP
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        return SpeculativeConfig(self.method, self.num_speculative_tokens, lo, hi, auto_k=self.auto_k)

    @property
    def uses_draft_model(self) -> bool:
        return self.method in ("draft_model", INT8_SELF_DRAFT)

    def describe(self) -> str:
        """One line for headers and logs: 'ngram k=3 (n-grams 2-4)', 'self-draft 8 layers k=3'."""
        k = f"<={self.num_speculative_tokens} auto" if self.auto_k else f"={self.num_speculative_tokens}"
        if self.method == "ngram":
            return f"ngram k{k} (n-grams {self.prompt_lookup_min}-{self.prompt_lookup_max})"
        if self.method == INT8_SELF_DRAFT:
            return f"int8 self-draft k{k}"
        if self.model == SELF_DRAFT:
            layers = "all layers" if self.num_draft_layers is None else f"{self.num_draft_layers} layers"
            return f"self-draft {layers} k{k}"
        return f"draft model {self.model} k{k}"

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "auto_k" and not v)}
