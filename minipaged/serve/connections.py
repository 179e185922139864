"""Open connections bounded, so that no number of sockets (held open, sending nothing, or sending headers a byte
at a time) can make the server stop answering; ``/health`` answers even then.

What went wrong without it: uvicorn accepts every connection and keeps one that sends nothing forever (its
keep-alive timer starts only after a first response, and any byte stops it). 1,100 such sockets used up the
process's 1,024 file descriptors, accepting failed with EMFILE, and ``/health`` went unanswered for 99 s.

Five parts, each against one way of holding the server:

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
- ``--max-client-connections``: one client (the address of the connection, as every per-client limit here; this
  machine has no bound) may hold that many open; a connection past it is refused as it opens, before a byte of
  HTTP is read: a 429 in OpenAI's error shape is written at once, the sending side closed, and what the client
  sends is read and dropped for at most ``REFUSED_DRAIN_S`` (so that it reads the answer instead of a reset).
  A refused connection is not counted among the open ones, so one client's 1,100 sockets neither reach
  ``--max-connections`` nor push out another client's; at most ``MAX_REFUSING`` refusals drain at once, the rest
  are closed straight after the answer is written. (uvicorn's ``limit_concurrency`` has no notion of a client.)
- ``--header-timeout``: a connection that has not sent a whole request line and headers within that many
  seconds of opening (or of its last response) is closed. The clock is not reset by data, so headers sent a byte
  at a time do not keep the socket either.
- An event stream's kernel send buffer is fixed at ``STREAM_SEND_BUFFER`` bytes. Left to itself, Linux grows a
  socket's send buffer toward ``net.ipv4.tcp_wmem``'s maximum (4 MB by default) for a peer that does not read:
  125 idle ``/v1/events`` connections took 487 MB of the kernel's memory (50 MB with the buffer fixed), and
  writing it kept the event loop from ``/health`` for over a second. With the buffer fixed, a watcher that stops
  reading costs that much of the kernel's memory, and its backlog reaches the event hub's limit (it is dropped)
  sooner.
"""
from __future__ import annotations

import json
import resource
import socket
from typing import Any, Optional

import h11

from .fair_share import on_this_machine
from .header_limit import HeaderLimitProtocol
from .http_guards import send_json
from .protocol import error_body

FD_RESERVE = 128                      # descriptors left for the engine: model files, logs, its own sockets
FD_TARGET = 65536                     # the soft limit asked for (never above the hard limit)
MIN_ROOM = 16                         # connections past the cap that are still accepted, to be answered
ALWAYS_ANSWERED = frozenset({"/health"})   # paths served whatever the number of connections
REFUSED_DRAIN_S = 1.0                 # a connection refused for its client's cap reads and drops this long at most
MAX_REFUSING = 256                    # refused connections draining at once; past it, closed after the answer
STREAM_SEND_BUFFER = 128 << 10        # SO_SNDBUF of an event stream (Linux keeps twice this, for its own books)
STREAM_PATHS = frozenset({"/v1/events"})   # endless streams: their send buffer does not grow


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


def fix_send_buffer(transport: Any, size: int = STREAM_SEND_BUFFER) -> None:
    """Fix the connection's kernel send buffer at ``size`` bytes (no growth toward the system's maximum)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, size)
        except OSError:                          # not a TCP socket (a test's pipe): nothing to fix
            pass


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
    """uvicorn's h11 protocol (with the 431 of ``HeaderLimitProtocol``) with the caps, the room, the eviction and
    the header timeout described above. Set ``max_connections`` and the rest on a subclass
    (``bounded_protocol``): uvicorn builds the protocol from its class alone."""

    max_connections: Optional[int] = None
    max_client_connections: Optional[int] = None
    refusal_answer: bytes = b""           # the 429 written to a connection past its client's cap (client_refusal)
    header_timeout_s: float = 10.0
    header_timer: Any = None
    counted_as: Optional[str] = None      # the client whose count this connection is in (None: not counted)
    refusing = False                      # refused for its client's cap: draining until closed

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.count_client():
            return self.refuse_client()
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

    def client_counts(self) -> dict[str, int]:
        """Open connections per client (not on this machine), on uvicorn's state shared by one server's
        connections."""
        state = self.server_state
        if not hasattr(state, "minipaged_per_client"):
            state.minipaged_per_client = {}
            state.minipaged_refusing = 0
        return state.minipaged_per_client

    def count_client(self) -> bool:
        """Count this connection against its client's cap; False if the client already holds that many."""
        host = self.client[0] if self.client else "unknown"
        if self.max_client_connections is None or on_this_machine(host):
            return True
        counts = self.client_counts()
        if counts.get(host, 0) >= self.max_client_connections:
            return False
        counts[host] = counts.get(host, 0) + 1
        self.counted_as = host
        return True

    def refuse_client(self) -> None:
        """The 429, written before anything is read; then drop what comes for a moment, and close."""
        self.connections.discard(self)                  # not one of the open connections the cap counts
        self.refusing = self.draining = True            # (HeaderLimitProtocol: what arrives is read and dropped)
        self.transport.write(self.refusal_answer)
        state = self.server_state
        if state.minipaged_refusing >= MAX_REFUSING or not self.transport.can_write_eof():
            self.refusing = False
            self.transport.close()                      # (sends what was written first)
            return
        state.minipaged_refusing += 1
        self.transport.write_eof()
        self.loop.call_later(REFUSED_DRAIN_S, self.transport.close)

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
        if self.counted_as is not None:
            counts = self.client_counts()
            counts[self.counted_as] -= 1
            if counts[self.counted_as] <= 0:
                del counts[self.counted_as]             # a client with no connection costs no memory
            self.counted_as = None
        if self.refusing:
            self.refusing = False
            self.server_state.minipaged_refusing -= 1
        super().connection_lost(exc)

    @property
    def app(self) -> Any:
        """The app for the request being started (uvicorn reads ``self.app`` once its scope is set): the real one,
        or the 503 when more than ``max_connections`` are open and the path is not always answered."""
        scope = getattr(self, "scope", None)
        if scope is not None and scope.get("path") in STREAM_PATHS:
            fix_send_buffer(self.transport)
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


def client_refusal(max_client_connections: int) -> bytes:
    """The whole HTTP answer to a connection past its client's cap, made once (it is written before the request
    is read, so it cannot depend on it)."""
    body = json.dumps(error_body(429, f"this client already has {max_client_connections} connections open to this "
                                      f"server, the most one client (address) may (minipaged serve "
                                      f"--max-client-connections): reuse a connection (keep-alive) or send fewer "
                                      f"requests at once, then retry.")).encode()
    head = (f"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"retry-after: 1\r\nconnection: close\r\n\r\n")
    return head.encode() + body


def bounded_protocol(max_connections: Optional[int], header_timeout_s: float,
                     max_client_connections: Optional[int] = None) -> type[ConnectionLimitProtocol]:
    """The protocol class for uvicorn's ``http=``, with these bounds."""
    per_client = None if max_client_connections is None else min(max_client_connections,
                                                                 max_connections or max_client_connections)
    return type("BoundedProtocol", (ConnectionLimitProtocol,),
                {"max_connections": max_connections, "header_timeout_s": header_timeout_s,
                 "max_client_connections": per_client,
                 "refusal_answer": client_refusal(per_client) if per_client is not None else b""})


def connection_settings(wanted: int, header_timeout_s: float,
                        per_client: Optional[int] = None) -> tuple[type[ConnectionLimitProtocol], str]:
    """At start-up: raise the fd limit, fit the cap under it; the protocol class and a line saying what was set."""
    fd_limit = raise_fd_limit()
    cap = fit_connections(wanted, fd_limit)
    protocol = bounded_protocol(cap, header_timeout_s, per_client)
    line = (f"at most {cap} connections (--max-connections), {protocol.max_client_connections} from one client "
            f"(--max-client-connections; this machine: no bound), {header_timeout_s:g} s to send a request's "
            f"headers (--header-timeout); file descriptors: {fd_limit}")
    if cap < wanted:
        line += f" (too few for --max-connections {wanted}: raise the hard limit, ulimit -Hn)"
    return protocol, line


__all__ = ["ConnectionLimitProtocol", "bounded_protocol", "client_refusal", "connection_settings", "fit_connections",
           "raise_fd_limit"]
