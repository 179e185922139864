"""Structured outputs: a grammar (xgrammar, vLLM's default backend) as a token mask in the logits stage.

A request's ``StructuredOutputsParams`` is *parsed* when it is queued (cheap, and independent of the
vocabulary: a bad schema, regex or grammar is refused there, naming the problem), then *compiled* against the
tokenizer in a background thread, as vLLM does: compiling walks the whole vocabulary for every grammar state
(about a millisecond per choice with SmolLM2's 49k tokens), far too slow for the step loop. The request
waits meanwhile (``RequestStatus.WAITING_FOR_GRAMMAR``); one that takes longer than ``timeout_s`` fails with
a message that says so. Compiled grammars are cached by their spec, so a repeated schema compiles once.
Each request (each of n samples) then gets its own ``GrammarMatcher``, which knows which tokens may come next. The mask is a bitmask over the vocabulary,
applied in place to the row's logits.

The matcher follows the row's history rather than being pushed by the engine: before masking a row it is
brought to that row's tokens (rolling back what differs, accepting what is new). So speculative decoding's
rows (the output plus 0..k drafts) each get the mask of their own position, drafts the grammar refuses can
never be accepted (their probability is 0), and the rejected ones are rolled back at the next step. A
recomputed (preempted) request keeps its tokens, so its matcher is already where it must be.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import queue
import re
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from ..config import GRAMMAR_TIMEOUT_S      # the engine option grammar_timeout's default
from ..request import InvalidRequestError, StructuredOutputsParams
from .processors import LogitsProcessor


def _library_message(exc: Exception) -> str:
    """xgrammar's message without its C++ time stamp and source location."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", text)


def regex_literal(text: str) -> str:
    """``text`` as a regex that matches exactly it (only metacharacters escaped: xgrammar warns on ``\\ ``)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


CACHE_SIZE = 64                 # compiled grammars kept (a schema a class sends again compiles once)
COMPILER_CACHE_BYTES = 256 << 20   # xgrammar's own cache of compiled pieces, bounded (it is unbounded by default)


@dataclass
class GrammarJob:
    """One spec's compilation, shared by every request (and sample) that asks for the same grammar."""

    future: Future
    started: float = field(default_factory=time.monotonic)


class StructuredOutputCompiler:
    """Parses structured-output requests at once and compiles them for one tokenizer in the background."""

    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float = GRAMMAR_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._compiler: Any = None
        self._work: Optional[queue.SimpleQueue] = None   # (future, grammar) for the compiling thread
        self._busy = threading.Event()           # set while the compiling thread is inside xgrammar
        self._jobs: OrderedDict[tuple[str, str], GrammarJob] = OrderedDict()   # spec -> its compilation (LRU)
        self._lock = threading.Lock()            # the compiler is built once, whichever thread asks first

    def _xgr(self) -> Any:
        try:
            import xgrammar as xgr              # imported on the first structured request only
        except ImportError:
            raise InvalidRequestError("structured outputs need the xgrammar package, which is not installed "
                                      "here: pip install xgrammar (or send the request without them).",
                                      "structured_outputs") from None
        return xgr

    def _grammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr()
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    @staticmethod
    def spec(params: StructuredOutputsParams) -> tuple[str, str]:
        """What the grammar is, as text: the cache key, and what ``parse`` reads."""
        kind = params.kind
        if kind == "json":
            return kind, params.schema_text()
        if kind == "json_object":                  # OpenAI's json_object: any JSON *object*
            return "json", '{"type": "object"}'
        if kind == "choice":
            return "regex", "|".join(regex_literal(c) for c in params.choice)
        return kind, params.regex if kind == "regex" else params.grammar

    def parse(self, params: StructuredOutputsParams) -> Any:
        """The grammar, parsed (no vocabulary involved: milliseconds); raises InvalidRequestError naming what is
        wrong with it."""
        xgr = self._xgr()
        kind, text = self.spec(params)
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(text, any_whitespace=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            return xgr.Grammar.from_ebnf(text)
        except Exception as exc:                    # xgrammar raises RuntimeError (C++) or ValueError
            what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                    "json_object": "JSON schema"}[params.kind]
            raise InvalidRequestError(f"invalid structured outputs {what}: {_library_message(exc)}",
                                      f"structured_outputs.{params.kind}") from None

    def compile(self, params: StructuredOutputsParams) -> GrammarJob:
        """Parse now (a bad grammar raises here), compile in the background; the same spec shares one job."""
        key = self.spec(params)
        with self._lock:
            job = self._jobs.get(key)
            if job is not None and not (job.future.done() and job.future.exception() is not None):
                self._jobs.move_to_end(key)
                return job
        grammar = self.parse(params)
        with self._lock:
            if self._work is None:
                self._work = queue.SimpleQueue()
                # A daemon thread, not a ThreadPoolExecutor: quitting must not wait for every queued compile.
                threading.Thread(target=_compile_forever, args=(self._grammar_compiler, self._work, self._busy),
                                 name="minipaged-grammar", daemon=True).start()
                atexit.register(self._at_exit)
            job = self._jobs[key] = GrammarJob(Future())
            self._work.put((job.future, grammar))
            while len(self._jobs) > CACHE_SIZE:
                self._jobs.popitem(last=False)
        return job

    def outcome(self, job: GrammarJob, since: float, now: Optional[float] = None) -> tuple[Any, Optional[str]]:
        """(compiled grammar, None) when it is ready, (None, why) when it failed or the request has waited for it
        longer than the limit (``since``: when it began waiting), and (None, None) while it still compiles."""
        if job.future.done():
            exc = job.future.exception()
            if exc is None:
                return job.future.result(), None
            return None, f"compiling the structured outputs grammar failed: {_library_message(exc)}"
        elapsed = (time.monotonic() if now is None else now) - since
        if elapsed > self.timeout_s:
            return None, (f"compiling the structured outputs grammar took longer than {self.timeout_s:g} s "
                          f"(--grammar-timeout); simplify the schema, regex, grammar or choices.")
        return None, None


    def _at_exit(self) -> None:
        """A daemon thread still inside xgrammar's C++ when Python finalises aborts the process ("terminate
        called without an active exception"): let a compile in flight end first, within the time limit, and
        otherwise leave at once (exit status 1, never a silent 0)."""
        assert self._work is not None
        self._work.put(None)                     # nothing queued starts now
        deadline = time.monotonic() + self.timeout_s
        while self._busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._busy.is_set():
            print("minipaged: a structured-output grammar was still compiling; exiting without waiting for it.",
                  file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)


def _compile_forever(make_compiler: Callable[[], Any], work: queue.SimpleQueue, busy: threading.Event) -> None:
    """The compiling thread: xgrammar lets go of the GIL while it compiles, so the step loop runs meanwhile. On
    a machine with few cores, the compile would still take a core from the step loop: the thread asks the OS
    for the lowest priority (Linux sets it per thread), so that steps come first. It builds xgrammar's compiler
    itself, after that, so that the worker threads xgrammar starts inherit the low priority."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    while (item := work.get()) is not None:
        future, grammar = item
        busy.set()
        try:
            future.set_result(make_compiler().compile_grammar(grammar))
        except Exception as exc:
            future.set_exception(exc)
        finally:
            busy.clear()


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
