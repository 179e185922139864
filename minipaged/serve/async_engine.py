"""One engine, many HTTP requests: the engine runs in one background thread; each request gets an asyncio queue.

The engine is synchronous and has no locks (``step()`` at a time), so exactly one thread touches it. HTTP
handlers run on the asyncio event loop and talk to that thread through a command queue:

    handler --submit(request_id, prepare)--> command queue --> engine thread: prepare, add_request
    handler <--Accepted / RequestDelta / error-- its asyncio.Queue <-- engine thread: step().outputs

``prepare`` runs in the engine thread and should only check what the engine's state decides: the routes
tokenise before they submit, on a worker with a tokenizer of its own (``tokenization``; fast tokenizers must not
be used from two threads at once, and the engine's is the detokenizer's), so no prompt's tokenising pauses a step.
A handler whose client goes away sends an abort command; the engine thread aborts the request before its next
step, which frees its blocks.
Clients' tokens come from what ``step()`` returns (its ``outputs``: one ``RequestDelta`` per request that
changed). Observers get the step's ``StepEvent``: the engine thread serialises it, once, for ``/v1/events``;
``event_hub`` fans the bytes out to the watchers on the event loop.

When the engine thread hands things to the event loop matters as much as what it hands. Python runs one
thread at a time (the GIL): if the HTTP thread wakes while the engine thread is between two calls, the
engine waits for the HTTP thread's Python to finish (about a millisecond per streamed token, on every token).
So the engine thread keeps its hand-offs in an outbox and passes them on when it lets go of the GIL for
long: the engine runs its ``before_model_call`` hook just before a decode step's compiled call (the cpu backend
does; kernels/backends/base.py), and the HTTP thread streams step N's tokens while step N+1 computes. Even
waking the event loop would give the GIL away (writing to its wake-up socket is a system call, which releases the GIL, and the woken loop takes it), so
the engine thread only drops the outbox on a queue: a courier thread, woken without a system call, takes the GIL
when the compiled call lets go of it and wakes the loop. vLLM V1 takes the same cost away with two processes (an
engine core and an API server); two threads and one well-placed hand-off do it here.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from ..event_view import EngineView, snapshot_event   # noqa: F401 (snapshot_event: its old home)
from ..events import StepEvent
from ..output_processor import sample_ids
from ..outputs import RequestDelta
from ..request import InvalidRequestError, SamplingParams
from .event_hub import EventHub, Watcher
from .fair_share import CLIENT, ClientQuotas, Ticket
from .protocol import ServerError
from .teacher import step_payloads

logger = logging.getLogger("minipaged.serve")

Prompt = Union[str, list[int]]
Prepare = Callable[[Any], tuple[Prompt, SamplingParams]]   # runs in the engine thread, gets the Engine
PROMPT_WAIT_S = 10.0            # how long a prompt look-up waits for the engine thread (which may be stuck)
RECENT_PROMPTS = 64             # finished requests whose whole prompt is still given on demand (a page shows them)
IDLE_POLL_S = 0.05              # how long an idle engine thread waits for a command before looking again


@dataclass(frozen=True)
class Accepted:
    """The engine took the request (it is queued): the first item of every successful stream."""

    params: SamplingParams


@dataclass
class _Stream:
    """The engine thread's record of one request it serves."""

    queue: asyncio.Queue
    prompt: Prompt = ""                      # as prepared (token ids, usually): the whole text on demand
    samples: tuple[str, ...] = ()            # its samples' ids, which events show (output_processor.sample_ids)


class AsyncEngine:
    """Drives one ``Engine`` from a background thread for asyncio callers."""

    def __init__(self, engine: Any, max_waiting_requests: Optional[int] = None,
                 quotas: Optional[ClientQuotas] = None, hand_off_at_model_call: bool = True) -> None:
        """``hand_off_at_model_call`` False (``minipaged serve --hand-off step-end``) hands each step's tokens over
        when the step ends instead, to measure what the hand-off point is worth (bench/peer_llamacpp.py)."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.quotas = quotas or ClientQuotas()           # per client (fair_share.CLIENT); no limit by default
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}          # engine thread only: request id -> its handler's queue
        self._sample_parent: dict[str, str] = {}        # engine thread only: sample id -> request id
        self._recent: OrderedDict[str, _Stream] = OrderedDict()   # engine thread only: finished, by sample id
        self._num_watchers = 0                          # engine thread only: serialise events while > 0
        self.hide_text = False                          # --hide-others-text: a copy of each event without text
        self.hub = EventHub()                           # event loop only
        self._view = EngineView(engine.info)            # engine thread only: what a late watcher must be told
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._num_submitted_not_added = 0               # guarded by _lock: samples, like requests_waiting
        self.num_in_flight = 0                          # event-loop side: generate() calls not ended yet
        self.draining: Optional[str] = None             # set on shutdown: why new requests are refused
        self.last_alive = time.monotonic()              # the engine thread's last loop (/health: is it stuck?)
        self._aborts_unpublished = False                # engine thread only
        self.stats: dict[str, float] = dict(engine.stats())   # replaced (never mutated) by the engine thread
        self._outbox: list[tuple[Callable[..., Any], tuple]] = []   # engine thread only: for the event loop
        self._batches: queue.SimpleQueue = queue.SimpleQueue()      # outboxes for the courier; None: stop
        self._courier: Optional[threading.Thread] = None
        self._loop_subscribers: list[Callable[[StepEvent], None]] = []
        self._handed_off = False                        # engine thread only: the hook ran during this step
        self._unsubscribe = engine.subscribe(self._on_event)
        # Removed on stop: the engine may be driven directly again.
        self._remove_hook = engine.before_model_call(self._hand_off) if hand_off_at_model_call else (lambda: None)

    # ------------------------------------------------------------------ life cycle (event-loop side)
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._courier = threading.Thread(target=self._carry, name="minipaged-courier", daemon=True)
        self._courier.start()
        self._thread = threading.Thread(target=self._run, name="minipaged-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._courier is not None:
            self._courier.join(timeout)
        self._remove_hook()
        self._unsubscribe()

    @property
    def engine_thread_alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def fail_all(self, error: ServerError) -> None:
        """End every request in flight with ``error`` (the server drains and its grace period is over)."""
        self._commands.put(("fail_all", error))

    @property
    def num_waiting(self) -> int:
        """Samples waiting for admission (a request with n=8 is 8), counting those not yet handed to the
        engine."""
        with self._lock:
            pending = self._num_submitted_not_added
        return pending + int(self.stats.get("requests_waiting", 0))

    # ------------------------------------------------------------------ requests (event-loop side)
    def check_admission(self, num_samples: int) -> None:
        """Refuse (503 while draining or busy, 400 when it could never fit) a request of ``num_samples`` samples.
        Admission counts samples: a request with n=600 puts 600 sequences in the queue, not one."""
        if self.draining:
            raise ServerError(503, f"{self.draining}: it takes no new requests; send them to another server.",
                              headers={"Retry-After": "1"})
        limit = self.max_waiting_requests
        if limit is not None and num_samples > limit:
            raise ServerError(400, f"this request asks for {num_samples} samples (n x prompts), more than may ever "
                                   f"wait at once on this server (--max-waiting-requests {limit}): lower n.", "n")
        if limit is not None and self.num_waiting + num_samples > limit:
            raise ServerError(503, f"the server is busy: {self.num_waiting} samples are waiting, and {num_samples} "
                                   f"more would pass the limit (--max-waiting-requests) of {limit}; retry shortly.",
                              headers={"Retry-After": "1"})

    async def generate(self, request_id: str, prepare: Prepare,
                       num_samples: int = 1) -> AsyncIterator[Union[Accepted, RequestDelta]]:
        """Submit a request and yield ``Accepted``, then its ``RequestDelta`` of each step that gave it something
        (``Engine.step().outputs``), the last one carrying the RequestOutput; a caller that fell behind gets the
        steps it missed merged into one delta. Raises ServerError / InvalidRequestError if it is refused.
        Leaving early (the client went away, the task was cancelled) aborts the request.

        Admission counts samples: a request with n=600 puts 600 sequences in the queue, not one."""
        self.check_admission(num_samples)
        ticket = self.quotas.take_samples(CLIENT.get() or "local", num_samples)
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._num_submitted_not_added += num_samples
        self._commands.put(("add", request_id, prepare, q, num_samples, ticket))
        self.num_in_flight += 1
        done = False
        held: Any = None                              # an item taken while catching up, next in line
        try:
            while True:
                if held is not None:
                    item, held = held, None
                else:
                    item = await q.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if isinstance(item, RequestDelta):
                    # Fell behind (the queue holds later steps' deltas too): send them as one.
                    while not item.finished and not q.empty():
                        later = q.get_nowait()
                        if not isinstance(later, RequestDelta):
                            held = later
                            break
                        item = item.followed_by(later)
                yield item
                if isinstance(item, RequestDelta) and item.finished:
                    done = True
                    return
        finally:
            self.num_in_flight -= 1
            self.quotas.release(ticket)
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    async def prompt_text(self, request_id: str) -> Optional[str]:
        """The whole prompt of a request in the engine or among the last ones finished (a parent id or a sample's
        id), decoded on the engine thread; None for any other id. Events carry a bounded preview only."""
        assert self._loop is not None
        answer: asyncio.Future = self._loop.create_future()
        self._commands.put(("prompt", request_id, answer))
        try:
            return await asyncio.wait_for(answer, PROMPT_WAIT_S)
        except asyncio.TimeoutError:
            raise ServerError(503, f"the engine thread did not answer within {PROMPT_WAIT_S:g} s; retry shortly.",
                              headers={"Retry-After": "1"}) from None

    def subscribe_in_loop(self, callback: Callable[[StepEvent], None]) -> None:
        """Call ``callback(event)`` on the event loop for every StepEvent, before that step's tokens reach their
        requests (metrics: a client that got its answer finds it counted). Subscribe before ``start``."""
        self._loop_subscribers.append(callback)

    def watch(self, watcher: Watcher) -> None:
        """Register ``watcher``: it gets the engine header, a snapshot of the current state, then every
        StepEvent (call ``unwatch`` when its connection ends)."""
        self._commands.put(("watch", watcher))

    def unwatch(self, watcher: Watcher) -> None:
        self.hub.remove(watcher)
        self._commands.put(("unwatch", watcher))

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stopping.is_set():
            self.last_alive = time.monotonic()
            idle = not self.engine.has_unfinished_requests()
            if idle:
                self._flush_outbox()              # nothing will run: hand everything over before waiting
            self._handle_commands(wait=idle)
            if not (self.engine.has_unfinished_requests() or self._aborts_unpublished):
                continue
            # An abort frees blocks at once, but only the next StepEvent tells metrics and watchers; when
            # nothing else runs, an empty step publishes it.
            self._aborts_unpublished = False
            self._handed_off = False
            try:
                result = self.engine.step()       # observers (metrics, _on_event) run inside
            except Exception as exc:              # a bug: fail the requests in flight, keep serving
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(ServerError(500, f"the engine failed: {exc}"))
            else:
                self._deliver(result.outputs)
            if not self._handed_off:              # this backend (or this step) has no hand-off point: now
                self._flush_outbox()
        self._fail_all(ServerError(503, "the server is shutting down."))
        self._flush_outbox()
        self._batches.put(None)                       # the courier's last batch

    def _hand_off(self) -> None:
        """The backend is about to let go of the GIL for the model's long call (``Engine.before_model_call``):
        what the last step produced goes to the event loop now, to be streamed while the model runs."""
        self._handed_off = True
        self._flush_outbox()

    def _flush_outbox(self) -> None:
        """Give the outbox to the courier (a queue put: no system call, so the engine thread keeps the GIL)."""
        if self._outbox:
            callbacks, self._outbox = self._outbox, []
            self._batches.put(callbacks)

    def _carry(self) -> None:
        """The courier thread: wakes the event loop once for each outbox, in order."""
        assert self._loop is not None
        while (callbacks := self._batches.get()) is not None:
            try:
                self._loop.call_soon_threadsafe(_run_in_order, callbacks)
            except RuntimeError:                      # the event loop is closed: the server is going down
                return

    def _handle_commands(self, wait: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_POLL_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            getattr(self, "_do_" + command[0])(*command[1:])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = dict(self.engine.stats())

    def _do_add(self, request_id: str, prepare: Prepare, q: asyncio.Queue, num_samples: int = 1,
                ticket: Optional[Ticket] = None) -> None:
        with self._lock:
            self._num_submitted_not_added -= num_samples
        try:
            prompt, params = prepare(self.engine)
            if ticket is not None:                    # the client's prompt tokens, now that they are known
                self.quotas.take_tokens(ticket, len(prompt) if not isinstance(prompt, str)
                                        else len(self.engine.tokenizer(prompt).input_ids))
            self.engine.add_request(prompt, params, request_id=request_id)
        except (InvalidRequestError, ServerError) as exc:
            self._send(q, exc if isinstance(exc, ServerError) else ServerError(400, str(exc), exc.param))
            return
        except Exception as exc:
            logger.exception("preparing request %s failed", request_id)
            self._send(q, ServerError(500, f"could not prepare the request: {exc}"))
            return
        samples = tuple(sample_ids(request_id, params.n))
        self._streams[request_id] = _Stream(q, prompt, samples)
        # (a sample's id leads to its request: the whole prompt on demand is asked for by the ids events show)
        self._sample_parent.update({sample: request_id for sample in samples})
        self._send(q, Accepted(params))

    def _do_abort(self, request_id: str) -> None:
        if self._forget(request_id) is None:
            return
        self.engine.abort(request_id)                 # frees its blocks now; the next event records it
        self._aborts_unpublished = True

    def _do_prompt(self, request_id: str, answer: asyncio.Future) -> None:
        stream = self._streams.get(self._sample_parent.get(request_id, request_id)) or self._recent.get(request_id)
        text = None
        if stream is not None:
            prompt = stream.prompt
            text = prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(prompt)
        self._call_soon(_settle, answer, text)

    def _do_fail_all(self, error: ServerError) -> None:
        self._fail_all(error)

    def _do_watch(self, watcher: Watcher) -> None:
        full, without_text = step_payloads(snapshot_event(self._view), not watcher.sees_text)
        first = [json.dumps({"type": "engine", **asdict(self.engine.info)}, separators=(",", ":")),
                 full if without_text is None else without_text]
        self._num_watchers += 1
        self._call_soon(self.hub.add, watcher, first)    # before any later event: the loop keeps the order

    def _do_unwatch(self, _watcher: Watcher) -> None:
        self._num_watchers -= 1

    def _on_event(self, event: StepEvent) -> None:
        """Called by the engine after every step, in the engine thread."""
        for callback in self._loop_subscribers:
            self._call_soon(callback, event)
        self._view.apply(event)
        for f in event.finished:                      # a long-running server must not remember every request
            self._view.requests.pop(f.request_id, None)
        if self._num_watchers:                        # once, whatever the number of watchers
            self._call_soon(self.hub.publish, *step_payloads(event, self.hide_text))
        self.stats = dict(event.counters)

    def _deliver(self, outputs: tuple[RequestDelta, ...]) -> None:
        """Hand each request its delta of the step (after the step's event: metrics count a token before its
        client sees it)."""
        for delta in outputs:
            stream = self._forget(delta.request_id) if delta.finished else self._streams.get(delta.request_id)
            if stream is not None:                    # (None: not a server request; someone else drives the engine)
                self._send(stream.queue, delta)

    def _forget(self, request_id: str) -> Optional[_Stream]:
        """Stop serving ``request_id``: its record, or None if it was not served."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for sample in stream.samples:
                self._sample_parent.pop(sample, None)
                self._recent[sample] = stream         # its whole prompt stays on demand a while (a page still
            self._recent[request_id] = stream         # shows it), for the last RECENT_PROMPTS ids
            while len(self._recent) > RECENT_PROMPTS:
                self._recent.popitem(last=False)
        return stream

    def _fail_all(self, error: ServerError) -> None:
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            self._do_abort(request_id)
            self._send(stream.queue, error)
        self._call_soon(self.hub.close_all)

    def _send(self, q: asyncio.Queue, item: Any) -> None:
        self._call_soon(q.put_nowait, item)

    def _call_soon(self, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` on the event loop, at the engine thread's next hand-off, in order."""
        self._outbox.append((callback, args))


def _settle(answer: asyncio.Future, value: Any) -> None:
    if not answer.done():                             # its HTTP request may have gone away meanwhile
        answer.set_result(value)


def _run_in_order(callbacks: list[tuple[Callable[..., Any], tuple]]) -> None:
    for callback, args in callbacks:
        try:
            callback(*args)
        except Exception:                             # one failing hand-off must not drop the others
            logger.exception("a hand-off from the engine thread failed")
