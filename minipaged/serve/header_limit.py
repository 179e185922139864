"""Request headers over ``MAX_HEADER_BYTES`` get 431 Request Header Fields Too Large, and the client reads it.

Two places see them. Headers that arrive in several reads are refused by h11 while incomplete (its
``max_incomplete_event_size``); uvicorn then answered 400 and closed the socket at once with the rest of the
client's headers unread, so the kernel reset the connection and the client saw no answer at all.
``HeaderLimitProtocol`` answers 431 in OpenAI's error shape instead, closes its sending side, and reads and drops
what the client still sends (for at most ``DRAIN_S`` and ``DRAIN_BYTES``) so that the answer is not lost.
Headers that arrive in one read (100 KB on loopback) pass h11 whole; ``HeaderLimit``, the outermost ASGI wrapper,
counts them and answers the same 431.
"""
from __future__ import annotations

import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .protocol import error_body

MAX_HEADER_BYTES = 16 * 1024          # h11's own default: a request line and headers bigger than this get 431
DRAIN_S = 2.0                         # how long a refused connection keeps reading before it closes
DRAIN_BYTES = 1 << 20                 # and how much it reads at most
CLOSE = (b"connection", b"close")


def refusal(limit: int) -> bytes:
    return json.dumps(error_body(431, f"the request's headers are over this server's limit of {limit} bytes: "
                                      f"send smaller headers (cookies, long header values).")).encode()


class HeaderLimit:
    """ASGI: headers (names and values, as sent) over ``max_bytes`` get 431 before any route sees them."""

    def __init__(self, app: Any, max_bytes: int = MAX_HEADER_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or sum(len(k) + len(v) + 4 for k, v in scope["headers"]) <= self.max_bytes:
            return await self.app(scope, receive, send)
        body = refusal(self.max_bytes)
        await send({"type": "http.response.start", "status": 431,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                CLOSE]})
        await send({"type": "http.response.body", "body": body})


class HeaderLimitProtocol(H11Protocol):
    """uvicorn's h11 protocol, but headers over h11's limit answer 431 and the answer reaches the client."""

    draining = False
    drained = 0

    def send_400_response(self, msg: str) -> None:
        """uvicorn calls this only when h11 refuses what was received; too much of it means headers too large."""
        limit = self.config.h11_max_incomplete_event_size or MAX_HEADER_BYTES
        if len(self.conn.trailing_data[0]) <= limit:
            return super().send_400_response(msg)
        body = refusal(limit)
        for event in (h11.Response(status_code=431, reason=b"Request Header Fields Too Large",
                                   headers=[(b"content-type", b"application/json"), CLOSE,
                                            (b"content-length", str(len(body)).encode())]),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.draining = True
        if self.transport.can_write_eof():
            self.transport.write_eof()                  # the answer is all sent; the client reads it, then EOF
        self.loop.call_later(DRAIN_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self.draining:
            return super().data_received(data)
        self.drained += len(data)                       # the rest of the refused headers: read and dropped
        if self.drained > DRAIN_BYTES:
            self.transport.close()
