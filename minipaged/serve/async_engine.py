"""The API server's side of the engine: each HTTP request gets an asyncio queue, the engine core gets commands.

The engine core runs apart from the event loop: in a process of its own under ``minipaged serve``, in a thread
for a server built around an ``Engine`` object (``core_client``). Either way it runs ``core_loop.CoreLoop`` and
this class only sends it commands and takes its messages, on the event loop:

    handler --generate(request_id, token ids, params)--> ("add", ...) --> core: add_request, step, step ...
    handler <--Accepted / RequestDelta / error-- its asyncio.Queue <-- ("accepted") / ("step", deltas, event)

The routes tokenise before they submit (``tokenization``: the API server's own tokenizer, off the event loop),
so the core never waits for a prompt's tokenising. A handler whose client goes away sends an abort; the core
aborts the request before its next step, which frees its blocks.
Clients' tokens come from each step's deltas (``Engine.step().outputs``: one ``RequestDelta`` per request that
changed). Observers get the step's ``StepEvent``, which the core serialised once (msgpack, in its process): here
metrics fold it, the late joiners' view folds it, and ``event_hub`` fans its JSON out to the watchers as bytes.
The whole prompt of a request on demand is decoded here too, from the token ids this side sent.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from ..event_view import EngineView, snapshot_event
from ..events import StepEvent
from ..output_processor import sample_ids
from ..outputs import RequestDelta
from ..request import SamplingParams
from .core_client import ServedModel, ThreadCore
from .core_loop import Message
from .event_hub import Chunk, EventHub, Watcher
from .fair_share import CLIENT, ClientQuotas
from .protocol import ServerError
from .teacher import step_payloads

logger = logging.getLogger("minipaged.serve")

RECENT_PROMPTS = 64             # finished requests whose whole prompt is still given on demand (a page shows them)


@dataclass(frozen=True)
class Accepted:
    """The engine took the request (it is queued): the first item of every successful stream."""

    params: SamplingParams


@dataclass
class _Stream:
    """This side's record of one request it serves."""

    queue: asyncio.Queue
    params: SamplingParams
    prompt: list[int]                        # the token ids sent: the whole prompt on demand
    samples: tuple[str, ...] = ()            # its samples' ids, which events show (output_processor.sample_ids)
    accepted: bool = False
    backlog: int = 0                         # what its reader has not taken yet (backlog_size of its deltas)


class AsyncEngine:
    """The engine core for asyncio callers: admission, a queue per request, the watchers and the metrics."""

    def __init__(self, core: Any, max_waiting_requests: Optional[int] = None,
                 quotas: Optional[ClientQuotas] = None, max_stream_backlog: Optional[int] = None) -> None:
        """``core``: a ``core_client.ProcessCore`` or ``ThreadCore`` (an ``Engine`` is run in a ``ThreadCore``).
        ``max_stream_backlog``: a request whose reader leaves more than this unread (``backlog_size``) is aborted
        with an error, and what waited for it is let go (None: no bound)."""
        self.max_stream_backlog = max_stream_backlog
        self.core = core if hasattr(core, "served") else ThreadCore(core)
        self.served: ServedModel = self.core.served
        self.max_waiting_requests = max_waiting_requests
        self.quotas = quotas or ClientQuotas()           # per client (fair_share.CLIENT); no limit by default
        self._streams: dict[str, _Stream] = {}           # request id -> its handler's queue
        self._sample_parent: dict[str, str] = {}         # sample id -> request id
        self._recent: OrderedDict[str, _Stream] = OrderedDict()   # finished, by sample id (whole prompts)
        self._num_sent_not_accepted = 0                  # samples, like requests_waiting
        self.hide_text = False                           # --hide-others-text: a copy of each event without text
        self.hub = EventHub()
        self._view = EngineView(self.served.info)        # what a late watcher must be told
        self._snapshots: dict[bool, list[Chunk]] = {}    # its first messages, by hidden text, until the next step
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.num_in_flight = 0                           # generate() calls not ended yet
        self.draining: Optional[str] = None              # set on shutdown: why new requests are refused
        self.dead: Optional[str] = None                  # set when the core is gone: why (every request fails)
        self.on_core_exit: Callable[[str], Any] = lambda _why: None   # the server stops (serve sets it)
        self.last_alive = time.monotonic()               # the core's last message (/health: is it stuck?)
        # the core's gauges and totals, as its last message said
        self.stats: dict[str, float] = dict(getattr(self.core, "initial_stats", {}))
        self._loop_subscribers: list[Callable[[StepEvent], None]] = []

    # ------------------------------------------------------------------ life cycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.core.start(self._receive, loop)

    def stop(self, timeout: float = 10.0) -> None:
        self.core.close(timeout)

    @property
    def core_alive(self) -> bool:
        return self.core.alive and self.dead is None

    def fail_all(self, error: ServerError) -> None:
        """End every request in flight with ``error`` (the server drains and its grace period is over; the event
        streams say goodbye themselves)."""
        for request_id in list(self._streams):
            stream = self._streams[request_id]
            self.abort(request_id)
            stream.queue.put_nowait(error)

    @property
    def num_waiting(self) -> int:
        """Samples waiting for admission (a request with n=8 is 8), counting those the core has not taken yet."""
        return self._num_sent_not_accepted + int(self.stats.get("requests_waiting", 0))

    # ------------------------------------------------------------------ requests
    def check_admission(self, num_samples: int) -> None:
        """Refuse (503 while draining or busy, 400 when it could never fit) a request of ``num_samples`` samples.
        Admission counts samples: a request with n=600 puts 600 sequences in the queue, not one."""
        if self.dead:
            raise ServerError(503, f"{self.dead}: this server cannot serve requests; restart it.")
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

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       num_samples: int = 1) -> AsyncIterator[Union[Accepted, RequestDelta]]:
        """Submit a request (its prompt's token ids) and yield ``Accepted``, then its ``RequestDelta`` of each step
        that gave it something, the last one carrying the RequestOutput; a caller that fell behind gets the
        steps it missed merged into one delta. Raises ServerError if it is refused. Leaving early (the client
        went away, the task was cancelled) aborts the request."""
        self.check_admission(num_samples)
        client = CLIENT.get() or "local"                  # the connection's address, never what the body says
        ticket = self.quotas.take_samples(client, num_samples)
        done = False
        try:
            if ticket is not None:                        # the client's prompt tokens, once per sample
                self.quotas.take_tokens(ticket, len(prompt))
            q: asyncio.Queue = asyncio.Queue()
            params = dataclasses.replace(params, client=client)   # the scheduler shares the engine by client
            samples = tuple(sample_ids(request_id, params.n))
            self._streams[request_id] = stream = _Stream(q, params, list(prompt), samples)
            # (a sample's id leads to its request: the whole prompt on demand is asked for by the ids events show)
            self._sample_parent.update({sample: request_id for sample in samples})
            self._num_sent_not_accepted += num_samples
            try:
                self.core.send(("add", request_id, list(prompt), params))
            except (OverflowError, ValueError, TypeError) as exc:    # msgpack: integers of 64 bits at most
                raise ServerError(400, f"this request carries a value the engine core cannot be sent ({exc}): "
                                       f"integers must fit in 64 bits (priority, seed ...).") from None
            self.num_in_flight += 1
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
                        run = [item]
                        while not run[-1].finished and not q.empty():
                            later = q.get_nowait()
                            if not isinstance(later, RequestDelta):
                                held = later
                                break
                            run.append(later)
                        stream.backlog -= sum(map(backlog_size, run))
                        item = run[0] if len(run) == 1 else RequestDelta.merged(run)
                    yield item
                    if isinstance(item, RequestDelta) and item.finished:
                        done = True
                        return
            finally:
                self.num_in_flight -= 1
        finally:
            self.quotas.release(ticket)
            if not done:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        stream = self._forget(request_id)
        if stream is not None:
            if not stream.accepted:
                self._num_sent_not_accepted -= stream.params.n
            self.core.send(("abort", request_id))

    async def prompt_text(self, request_id: str, decode: Callable[[list[int]], Any]) -> Optional[str]:
        """The whole prompt of a request in the engine or among the last ones finished (a parent id or a sample's
        id), decoded by ``decode`` (an awaitable: the tokenizer's worker); None for any other id. Events carry a
        bounded preview only."""
        stream = self._streams.get(self._sample_parent.get(request_id, request_id)) or self._recent.get(request_id)
        return None if stream is None else await decode(stream.prompt)

    def subscribe_in_loop(self, callback: Callable[[StepEvent], None]) -> None:
        """Call ``callback(event)`` on the event loop for every StepEvent, before that step's tokens reach their
        requests (metrics: a client that got its answer finds it counted)."""
        self._loop_subscribers.append(callback)

    def watch(self, watcher: Watcher) -> None:
        """Register ``watcher``: it gets the engine header, a snapshot of the current state, then every
        StepEvent (call ``unwatch`` when its connection ends). The snapshot is made once a step for all the
        watchers that join in it: a class that opens its pages at once (or 125 connections that never read)
        costs one serialisation of the engine's state, not one each, on the loop that answers everyone."""
        hide = not watcher.sees_text
        if hide not in self._snapshots:
            full, without_text = step_payloads(snapshot_event(self._view), hide)
            header = json.dumps({"type": "engine", **asdict(self.served.info)}, separators=(",", ":"))
            self._snapshots[hide] = [Chunk.data(header), Chunk.data(full if without_text is None else without_text)]
        self.hub.add(watcher, self._snapshots[hide])

    def unwatch(self, watcher: Watcher) -> None:
        self.hub.remove(watcher)

    # ------------------------------------------------------------------ the core's messages (on the event loop)
    def _receive(self, messages: list[Message]) -> None:
        self.last_alive = time.monotonic()
        for message in messages:
            try:
                getattr(self, "_on_" + message[0])(*message[1:])
            except Exception:                         # one failing message must not drop the others
                logger.exception("handling the engine core's %r message failed", message[0])

    def _on_accepted(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.accepted:
            stream.accepted = True
            self._num_sent_not_accepted -= stream.params.n
            stream.queue.put_nowait(Accepted(stream.params))

    def _on_refused(self, request_id: str, status: int, message: str, param: Optional[str]) -> None:
        stream = self._forget(request_id, keep_prompt=False)
        if stream is not None:
            self._num_sent_not_accepted -= stream.params.n
            stream.queue.put_nowait(ServerError(status, message, param))

    def _on_step(self, deltas: list[RequestDelta], event: StepEvent) -> None:
        for callback in self._loop_subscribers:
            callback(event)
        self._view.apply(event)
        self._snapshots.clear()                       # the state moved on
        for f in event.finished:                      # a long-running server must not remember every request
            self._view.requests.pop(f.request_id, None)
        if self.hub.watchers:                         # once, whatever the number of watchers
            self.hub.publish(*step_payloads(event, self.hide_text))
        self.stats = dict(event.counters)
        # Each request's delta, after the step's event: metrics count a token before its client sees it.
        for delta in deltas:
            stream = self._forget(delta.request_id) if delta.finished else self._streams.get(delta.request_id)
            if stream is not None:                    # (None: aborted meanwhile)
                stream.backlog += backlog_size(delta)
                stream.queue.put_nowait(delta)
                limit = self.max_stream_backlog
                if limit is not None and stream.backlog > limit and not delta.finished:
                    self._drop_slow_reader(delta.request_id, stream, limit)

    def _drop_slow_reader(self, request_id: str, stream: _Stream, limit: int) -> None:
        """The reader stopped reading (or reads slower than the engine writes): end its request rather than hold
        its output without bound. The engine never waits for a reader; pausing the request instead would keep
        its KV blocks from everyone else for as long as the reader sleeps."""
        self.abort(request_id)
        while not stream.queue.empty():               # what it left unread goes now, not when it reads again
            stream.queue.get_nowait()
        stream.queue.put_nowait(ServerError(
            503, f"this request was aborted: its reader left more than {limit} tokens (log-probabilities count) "
                 f"unread, the most this server holds for one stream (minipaged serve --max-stream-backlog). Read "
                 f"the stream as it comes, or ask for fewer samples or log-probabilities."))

    def _on_stats(self, stats: dict[str, float]) -> None:
        self.stats = stats

    def _on_failed(self, message: str) -> None:       # a step raised; the core aborted its requests
        self._fail_streams(ServerError(500, message))

    def _fail_streams(self, error: ServerError) -> None:
        """End every stream in flight with ``error``, for a core that has already let go of their requests."""
        for request_id in list(self._streams):
            stream = self._forget(request_id)
            if stream is not None:
                stream.queue.put_nowait(error)

    def _on_alive(self) -> None:
        pass

    def _on_exited(self, why: str) -> None:
        """The core is gone (killed, crashed): every request in flight gets an error, /health says why, and the
        server stops (it cannot serve without its core)."""
        self.dead = why
        logger.error("%s; failing the requests in flight and stopping the server", why)
        self._fail_streams(ServerError(500, f"{why} while this request was served."))
        self.hub.close_all()
        self.on_core_exit(why)

    def _forget(self, request_id: str, keep_prompt: bool = True) -> Optional[_Stream]:
        """Stop serving ``request_id``: its record, or None if it was not served."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            for sample in stream.samples:
                self._sample_parent.pop(sample, None)
                if keep_prompt:
                    self._recent[sample] = stream     # its whole prompt stays on demand a while (a page still
            if keep_prompt:                           # shows it), for the last RECENT_PROMPTS ids
                self._recent[request_id] = stream
            while len(self._recent) > RECENT_PROMPTS:
                self._recent.popitem(last=False)
        return stream


def backlog_size(delta: RequestDelta) -> int:
    """What a delta holds, as the slow-reader bound counts it: its tokens, and each of their log-probability
    entries (with logprobs=20 a token brings 21 entries, each decoded into text)."""
    return sum(len(s.token_ids) + sum(map(len, s.logprobs)) for s in delta.samples)
