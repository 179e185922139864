"""Open connections bounded, so that no number of sockets (held open, sending nothing, or sending headers a byte
at a time) can make the server stop answering; ``/health`` answers even then.

What went wrong without it: uvicorn accepts every connection and keeps one that sends nothing forever (its
keep-alive timer starts only after a first response, and any byte stops it). 1,100 such sockets used up the
process's 1,024 file descriptors, accepting failed with EMFILE, and ``/health`` went unanswered for 99 s.

Four parts, each against one way of holding the server:

- ``raise_fd_limit``: the soft limit on file descriptors goes up toward the hard one at start-up (1,024 is a
  common soft limit and far below what a class needs), and ``fit_connections`` keeps the connections below it
  with ``FD_RESERVE`` left over for the engine's own files (model files, logs, sockets of its own).
- ``--max-connections``: a request that arrives while more connections than that are open gets 503 in OpenAI's
  error shape, with Retry-After. This replaces uvicorn's ``limit_concurrency``, which answers ``/health`` 503 as
  well (it counts before it looks at the path) and in plain text; ``/health`` (``ALWAYS_ANSWERED``) is exempt,
  so a load balancer still learns the truth from it.
- Connections past the cap, up to ``room`` more, are accepted so that they can be answered (503, or ``/health``).
  Past that, a new connection pushes out the one that has waited longest for a request: a socket that sends
  nothing is worth less than one that just arrived. Only when every open connection is busy with a request is
  the new one closed at once.
- ``--header-timeout``: a connection that has not sent a whole request line and headers within that many
  seconds of opening (or of its last response) is closed. The clock is not reset by data, so headers sent a byte
  at a time do not keep the socket either.
"""
from __future__ import annotations

import resource
from typing import Any, Optional

import h11

from .header_limit import HeaderLimitProtocol
from .http_guards import send_json
from .protocol import error_body

FD_RESERVE = 128                      # descriptors left for the engine: model files, logs, its own sockets
FD_TARGET = 65536                     # the soft limit asked for (never above the hard limit)
MIN_ROOM = 16                         # connections past the cap that are still accepted, to be answered
ALWAYS_ANSWERED = frozenset({"/health"})   # paths served whatever the number of connections


def raise_fd_limit(target: int = FD_TARGET) -> int:
    """Raise this process's soft limit on open files toward ``target`` (at most the hard limit, where the system
    allows it); returns the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):            # macOS refuses more than OPEN_MAX: keep what there is
            pass
    return soft if soft != resource.RLIM_INFINITY else target


def room_for(cap: int) -> int:
    """How many connections past ``cap`` are accepted to be answered (503, or /health)."""
    return max(MIN_ROOM, cap // 8)


def fit_connections(wanted: int, fd_limit: int) -> int:
    """The connection cap: ``wanted``, or less where the file descriptors would not hold it and its room."""
    usable = max(2, fd_limit - FD_RESERVE)
    if wanted + room_for(wanted) <= usable:
        return wanted
    return max(1, usable - max(MIN_ROOM, usable // 9))


class ConnectionLimitProtocol(HeaderLimitProtocol):
    """uvicorn's h11 protocol (with the 431 of ``HeaderLimitProtocol``) with the cap, the room, the eviction and
    the header timeout described above. Set ``max_connections`` and ``header_timeout_s`` on a subclass
    (``bounded_protocol``): uvicorn builds the protocol from its class alone."""

    max_connections: Optional[int] = None
    header_timeout_s: float = 10.0
    header_timer: Any = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        waiting = self.waiting_connections()
        if self.max_connections is not None and len(self.connections) > self.max_connections + room_for(
                self.max_connections):
            if waiting:                                 # the longest wait for a request gives its place up
                oldest = next(iter(waiting))
                oldest.close_waiting()
            else:                                       # every other connection is busy with a request
                self.transport.close()
                return
        self.await_request()

    def waiting_connections(self) -> dict["ConnectionLimitProtocol", None]:
        """This server's connections now waiting for a request, the longest-waiting first (an ordered set, kept
        on uvicorn's state shared by one server's connections)."""
        state = self.server_state
        if not hasattr(state, "minipaged_waiting"):
            state.minipaged_waiting = {}
        return state.minipaged_waiting

    def await_request(self) -> None:
        """Start the clock on a connection that owes a request: it is closed if none has arrived in time."""
        self.stop_clock()
        if not self.transport.is_closing():
            self.waiting_connections()[self] = None
            self.header_timer = self.loop.call_later(self.header_timeout_s, self.close_waiting)

    def stop_clock(self) -> None:
        self.waiting_connections().pop(self, None)
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def close_waiting(self) -> None:
        self.stop_clock()
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.header_timer is not None and self.conn.their_state is not h11.IDLE:
            self.stop_clock()                           # a whole request line and headers arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:           # (a pipelined request may have started already)
            self.await_request()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self.stop_clock()
        super().connection_lost(exc)

    @property
    def app(self) -> Any:
        """The app for the request being started (uvicorn reads ``self.app`` once its scope is set): the real one,
        or the 503 when more than ``max_connections`` are open and the path is not always answered."""
        scope = getattr(self, "scope", None)
        if (self.max_connections is None or len(self.connections) <= self.max_connections or scope is None
                or scope.get("path") in ALWAYS_ANSWERED):
            return self._app
        return self.over_capacity

    @app.setter
    def app(self, value: Any) -> None:
        self._app = value

    async def over_capacity(self, scope: Any, receive: Any, send: Any) -> None:
        message = (f"this server has more than {self.max_connections} connections open (minipaged serve "
                   f"--max-connections): retry in a moment.")
        await send_json(send, 503, error_body(503, message), ((b"retry-after", b"1"), (b"connection", b"close")))


def bounded_protocol(max_connections: Optional[int], header_timeout_s: float) -> type[ConnectionLimitProtocol]:
    """The protocol class for uvicorn's ``http=``, with these bounds."""
    return type("BoundedProtocol", (ConnectionLimitProtocol,),
                {"max_connections": max_connections, "header_timeout_s": header_timeout_s})


def connection_settings(wanted: int, header_timeout_s: float) -> tuple[type[ConnectionLimitProtocol], str]:
    """At start-up: raise the fd limit, fit the cap under it; the protocol class and a line saying what was set."""
    fd_limit = raise_fd_limit()
    cap = fit_connections(wanted, fd_limit)
    line = (f"at most {cap} connections (--max-connections), {header_timeout_s:g} s to send a request's headers "
            f"(--header-timeout); file descriptors: {fd_limit}")
    if cap < wanted:
        line += f" (too few for --max-connections {wanted}: raise the hard limit, ulimit -Hn)"
    return bounded_protocol(cap, header_timeout_s), line


__all__ = ["ConnectionLimitProtocol", "bounded_protocol", "connection_settings", "fit_connections",
           "raise_fd_limit"]
