"""The engine core's busy loop, as the server runs it: commands in, one message per step out.

This is vLLM v1's ``EngineCoreProc.run_busy_loop`` in miniature, and it knows nothing of HTTP, clients or how
its messages travel. ``minipaged serve`` runs it in a process of its own (``core_process``: ZeroMQ and msgpack
carry the messages), a server built around an ``Engine`` object in one process runs it in a thread
(``core_client.ThreadCore``); the API server's side (``async_engine``) is the same for both.

Commands (tuples; the first item names them):
    ("add", request_id, prompt_token_ids, SamplingParams)     queue a request (the API server tokenised it)
    ("abort", request_id)                                    the client went away, or the server ends it
    ("stop",)                                                leave the loop
Outputs, handed to ``emit`` as one list per pass of the loop:
    ("accepted", request_id) / ("refused", request_id, status, message, param)
    ("step", [RequestDelta, ...], StepEvent)                 every step: the clients' deltas and the observers'
    ("stats", {name: value})                                 the engine's gauges after a batch of commands
    ("failed", message)                                      a step raised: its requests are aborted
    ("alive",)                                               an idle core's heartbeat (/health: is it stuck?)
"""
from __future__ import annotations

import logging
import queue
import time
from typing import Any, Callable

from ..request import InvalidRequestError

logger = logging.getLogger("minipaged.serve")

IDLE_POLL_S = 0.05              # how long an idle core waits for a command before looking again
HEARTBEAT_S = 0.5               # an idle core says it is alive this often
Message = tuple                 # ("kind", *fields)


class CoreLoop:
    """Drives one ``Engine``: the only code that touches it while the server runs."""

    def __init__(self, engine: Any, emit: Callable[[list[Message]], None]) -> None:
        self.engine = engine
        self.emit = emit
        self.commands: queue.SimpleQueue = queue.SimpleQueue()     # put from any thread
        self._served: set[str] = set()           # request ids queued and not finished (aborted all if a step fails)
        self._aborts_unpublished = False
        self._last_heartbeat = 0.0

    def run(self) -> None:
        """Until a ``("stop",)`` command: take commands (waiting for one when idle), step, emit."""
        self.emit([("stats", dict(self.engine.stats()))])          # /health and /load before the first step
        while True:
            out: list[Message] = []
            idle = not (self.engine.has_unfinished_requests() or self._aborts_unpublished)
            if not self._handle_commands(out, wait=idle):
                if out:
                    self.emit(out)
                return
            if self.engine.has_unfinished_requests() or self._aborts_unpublished:
                # An abort frees blocks at once, but only the next StepEvent tells metrics and watchers; when
                # nothing else runs, an empty step publishes it.
                self._aborts_unpublished = False
                self._step(out)
            elif time.monotonic() - self._last_heartbeat > HEARTBEAT_S:
                self._last_heartbeat = time.monotonic()
                out.append(("alive",))
            if out:
                self.emit(out)

    def _step(self, out: list[Message]) -> None:
        try:
            result = self.engine.step()
        except Exception as exc:              # a bug: abort the requests in flight, keep serving
            logger.exception("engine step failed; aborting the requests in flight")
            for request_id in self._served:
                self.engine.abort(request_id)
            self._served.clear()
            out.append(("failed", f"the engine failed: {exc}"))
            return
        for delta in result.outputs:
            if delta.finished:
                self._served.discard(delta.request_id)
        out.append(("step", list(result.outputs), result.event))

    def _handle_commands(self, out: list[Message], wait: bool) -> bool:
        """Every command waiting (the first one waited for, briefly, when ``wait``); False on ``stop``."""
        try:
            command = self.commands.get(timeout=IDLE_POLL_S) if wait else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            getattr(self, "_do_" + command[0])(out, *command[1:])
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                break
        out.append(("stats", dict(self.engine.stats())))
        return True

    def _do_add(self, out: list[Message], request_id: str, prompt: list[int], params: Any) -> None:
        try:
            self.engine.add_request(prompt, params, request_id=request_id)
        except InvalidRequestError as exc:
            out.append(("refused", request_id, 400, str(exc), exc.param))
            return
        except Exception as exc:
            logger.exception("queueing request %s failed", request_id)
            out.append(("refused", request_id, 500, f"could not queue the request: {exc}", None))
            return
        self._served.add(request_id)
        out.append(("accepted", request_id))

    def _do_abort(self, out: list[Message], request_id: str) -> None:
        if request_id in self._served:
            self._served.discard(request_id)
            self.engine.abort(request_id)         # frees its blocks now; the next event records it
            self._aborts_unpublished = True
