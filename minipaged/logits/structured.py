"""Structured outputs: a grammar (xgrammar, vLLM's default backend) as a token mask in the logits stage.

A request's ``StructuredOutputsParams`` is compiled once when it is queued (a bad schema, regex or grammar
is refused there, naming the problem); each request (each of n samples) then gets its own
``GrammarMatcher``, which knows which tokens may come next. The mask is a bitmask over the vocabulary,
applied in place to the row's logits.

The matcher follows the row's history rather than being pushed by the engine: before masking a row it is
brought to that row's tokens (rolling back what differs, accepting what is new). So speculative decoding's
rows (the output plus 0..k drafts) each get the mask of their own position, drafts the grammar refuses can
never be accepted (their probability is 0), and the rejected ones are rolled back at the next step. A
recomputed (preempted) request keeps its tokens, so its matcher is already where it must be.
"""
from __future__ import annotations

import re
from typing import Any, Optional, Sequence

import torch

from ..request import InvalidRequestError, StructuredOutputsParams
from .processors import LogitsProcessor


def _library_message(exc: Exception) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)


def regex_literal(text: str) -> str:
    """``text`` as a regex that matches exactly it (only metacharacters escaped: xgrammar warns on ``\\ ``)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


class StructuredOutputCompiler:
    """Compiles structured-output requests for one tokenizer (xgrammar caches compiled grammars)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None

    def _xgr(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar as xgr              # imported on the first structured request only
            except ImportError:
                raise InvalidRequestError("structured outputs need the xgrammar package, which is not installed "
                                          "here: pip install xgrammar (or send the request without them).") from None
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar; raises InvalidRequestError naming what is wrong with the request's grammar."""
        compiler = self._xgr()
        kind = params.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(params.schema_text(), any_whitespace=False)
            if kind == "json_object":                  # OpenAI's json_object: any JSON *object*
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_regex("|".join(regex_literal(c) for c in params.choice))
            return compiler.compile_grammar(params.grammar)
        except InvalidRequestError:
            raise
        except Exception as exc:                    # xgrammar raises RuntimeError (C++) or ValueError
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[kind]
            raise InvalidRequestError(f"invalid structured outputs {what}: {_library_message(exc)}") from None


class GrammarMask(LogitsProcessor):
    """The tokens a request's grammar allows next; one per request (the matcher holds its parse state)."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)     # rollback is unlimited in xgrammar 0.2
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.consumed: list[int] = []         # the tokens the matcher has accepted, in order
        self.num_allowed: Optional[int] = None  # how many tokens the last mask allowed (for the event log)

    def sync(self, output_token_ids: Sequence[int]) -> bool:
        """Bring the matcher to ``output_token_ids``; False if the grammar refuses one of them (a draft the
        mask will have made impossible to accept: the row that follows it is never used)."""
        common = 0
        limit = min(len(self.consumed), len(output_token_ids))
        while common < limit and self.consumed[common] == output_token_ids[common]:
            common += 1
        if common < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - common)
            del self.consumed[common:]
        for token in output_token_ids[common:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                return False
            self.consumed.append(int(token))
        return True

    def apply(self, logits, prompt_token_ids, output_token_ids) -> None:
        if not self.sync(output_token_ids) or self.matcher.is_terminated():
            return
        self.matcher.fill_next_token_bitmask(self.bitmask)
        row = logits.unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(row, self.bitmask.to(row.device))
        self.num_allowed = int(torch.isfinite(logits).sum())
