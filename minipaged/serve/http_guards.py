"""ASGI wrappers in front of the routes: the API key check, a bound on request bodies, JSON bodies only, HEAD on
every GET route, and who the client is (for per-client limits). ``host_check`` is one more, with its own module.

All act before FastAPI parses anything: a request without the key is refused before its body is read, a body
over the limit is refused without being read into memory (a 1 MB body of stop strings once doubled every
request's step time), and health checkers that send HEAD get the GET route's status and headers without its body.

Why plain ASGI classes and not ``@app.middleware("http")``: Starlette runs such a function as a
``BaseHTTPMiddleware``, which passes every chunk of a streamed response through a memory stream and a task of its
own. With one token per chunk that was most of the server's own work per token (0.65 ms of CPU a token for one
streamed request), which took the CPU from the engine (its steps ran 1.3 ms slower inside the server than
alone, when the two shared a process). These wrappers hand ``send`` through untouched.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Awaitable, Callable

from .fair_share import CLIENT
from .protocol import ServerLimits, error_body
from .teacher import TEACHER, is_page_route

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


async def send_json(send: Send, status: int, body: dict[str, Any], headers: tuple = ()) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": data})


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with a 413 naming the flag: by Content-Length when the client sends
    one, else while reading (the body is then handed on from memory, at most ``max_bytes`` of it)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def refusal(self, size: str) -> dict[str, Any]:
        return error_body(413, f"the request body is {size} bytes, over this server's limit of {self.max_bytes} "
                               f"bytes (minipaged serve {ServerLimits.flag('max_body_bytes')}).")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_bytes:
                return await send_json(send, 413, self.refusal(length.decode()), ((b"connection", b"close"),))
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:                                     # no length given: read up to the limit
            message = await receive()
            if message["type"] != "http.request":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await send_json(send, 413, self.refusal(f"more than {self.max_bytes}"),
                                       ((b"connection", b"close"),))
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()                 # then the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay, send)


class JsonBodies:
    """A POST whose Content-Type is not JSON gets 400 "send application/json" (FastAPI would read a text/plain
    body as a string and say "Input should be a valid dictionary"). No Content-Type at all is read as JSON, as
    FastAPI does. It also closes the door that HTML forms open: a form can post text/plain across sites without
    asking, JSON it cannot."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type")
            if given is not None:
                media = given.decode("latin-1").split(";")[0].strip().lower()
                if media != "application/json" and not media.endswith("+json"):
                    return await send_json(send, 400, error_body(
                        400, f"the body's Content-Type is {media or 'empty'!r}: send application/json (the header "
                             f"'Content-Type: application/json') with a JSON object."))
        await self.app(scope, receive, send)


class ClientAddress:
    """Sets ``CLIENT`` to the address the request came from, for the per-client limits (``fair_share``), which
    read it in the handler's task. The address, not the API key: a class shares one key."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        client = scope.get("client")
        token = CLIENT.set(client[0] if client else "unknown")
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT.reset(token)


class HeadAsGet:
    """HEAD on a GET route answers as GET would, without the body (uvicorn drops it). The event stream never
    ends, so HEAD there answers at once with the stream's headers."""

    def __init__(self, app: ASGIApp, endless: tuple[str, ...]) -> None:
        self.app, self.endless = app, endless

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        if scope["path"] in self.endless:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
            return await send({"type": "http.response.body", "body": b""})
        await self.app({**scope, "method": "GET"}, receive, send)


# Outside /v1 and behind the key all the same: the API's description, and vLLM's tokenizer routes (vLLM leaves
# those open; here they spend the server's CPU on a stranger's text and show the chat template, so they are not).
KEYED_PATHS = frozenset({"/openapi.json", "/tokenize", "/detokenize", "/tokenizer_info"})


class ApiKeyCheck:
    """With ``--api-key``, every ``/v1`` route (and ``KEYED_PATHS``) wants ``Authorization: Bearer KEY``; health
    and metrics stay open, as in vLLM. Without a key it is not installed at all. A request with the key is the
    teacher's (``teacher.TEACHER``); with ``open_page`` the page's own routes also answer students without it."""

    def __init__(self, app: ASGIApp, api_key: str, open_page: bool = False) -> None:
        self.app, self.expected, self.open_page = app, f"Bearer {api_key}".encode(), open_page

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        teacher = secrets.compare_digest(given, self.expected)
        if (path.startswith("/v1") or path in KEYED_PATHS) and not teacher and not (
                self.open_page and is_page_route(path)):
            return await send_json(send, 401, error_body(401, "missing or wrong API key: send the header "
                                                              "'Authorization: Bearer <key>' with the server's "
                                                              "--api-key."))
        token = TEACHER.set(teacher)
        try:
            await self.app(scope, receive, send)
        finally:
            TEACHER.reset(token)
