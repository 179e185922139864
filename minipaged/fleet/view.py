"""The fleet view's server: one page that draws every replica side by side (``web/static/fleet.html``).

The page cannot read the replicas' ``/v1/events`` itself (another origin, and replicas on other machines may
not be reachable from the browser), so this server relays them: ``/replica/N/v1/events`` is replica N's
stream, byte for byte. The page's prompt box posts to ``/v1/chat/completions`` here, relayed to the router,
so a student's request is routed like any client's and the page sees on which replica it lands. Nothing is
folded here: as in the single-engine view, each browser folds the events itself.

Where the router sent each request (lesson 11's question: which replica did each tenant land on?) is history a
page that opens late could not see, so this server follows every replica's events from the start
(``RoutingHistory``) and keeps the last requests' replica and prompt preview for ``/landed.json``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from collections import deque
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from minipaged import web

from .replicas import Replica

NO_CACHE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
FORWARDED_HEADERS = ("content-type", "authorization", "accept")
LANDED_KEPT = 200                        # requests whose replica /landed.json remembers (the newest)
RECONNECT_S = 1.0


@dataclass(frozen=True)
class FleetLayout:
    """What the page is told about the fleet (``/fleet.json``)."""

    replicas: list[Replica]
    router_url: str
    policy: str
    router_pid: Optional[int] = None

    def as_json(self) -> dict[str, Any]:
        """The page's layout; the pids let a supervisor (or a test) check that a stopped fleet left nothing."""
        return {"router": self.router_url, "policy": self.policy, "router_pid": self.router_pid,
                "replicas": [{"index": i, "url": r.url, "pid": r.pid} for i, r in enumerate(self.replicas)]}


class RoutingHistory:
    """Which replica each recent request landed on, with its prompt's preview (what the events' arrivals carry),
    read from every replica's event stream since the fleet started: a page that opens late still sees where the
    router sent the requests before it (``/landed.json``; newest first)."""

    def __init__(self, replicas: list[Replica], kept: int = LANDED_KEPT) -> None:
        self.replicas = replicas
        self.landed: deque[dict[str, Any]] = deque(maxlen=kept)
        self._ids: set[str] = set()
        self.why_not: dict[int, str] = {}           # a replica whose events cannot be read: why

    def record(self, replica: int, step: int, arrivals: list[dict[str, Any]]) -> None:
        """The arrivals of one step (a reconnection's snapshot repeats the requests still in the engine: once)."""
        for a in arrivals:
            rid = a.get("request_id")
            if not rid or rid in self._ids:
                continue
            if len(self.landed) == self.landed.maxlen:
                self._ids.discard(self.landed[0]["request_id"])
            self._ids.add(rid)
            self.landed.append({"request_id": rid, "name": a.get("name") or rid, "replica": replica,
                                "prompt": a.get("prompt", ""), "step": step})

    def as_json(self) -> dict[str, Any]:
        return {"landed": list(reversed(self.landed)), "unread": {str(i): why for i, why in self.why_not.items()}}

    async def follow(self, index: int) -> None:
        """Read replica ``index``'s events until cancelled, reconnecting when they end (a replica restarting)."""
        url = self.replicas[index].url + "/v1/events"
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None)) as client:
            while True:
                try:
                    async with client.stream("GET", url, headers={"Accept-Encoding": "identity"}) as answer:
                        if answer.status_code != 200:
                            self.why_not[index] = f"its events answered {answer.status_code}"
                        else:
                            self.why_not.pop(index, None)
                            async for line in answer.aiter_lines():
                                self._read(index, line)
                except (httpx.HTTPError, ValueError) as exc:
                    self.why_not[index] = f"cannot read its events: {exc}"
                await asyncio.sleep(RECONNECT_S)

    def _read(self, index: int, line: str) -> None:
        if not line.startswith("data: {"):
            return                                   # named events (goodbye, dropped), comments, blank lines
        record = json.loads(line[6:])
        if record.get("type") == "step" and record.get("arrivals"):
            self.record(index, int(record.get("step", 0)), record["arrivals"])


async def relay(method: str, url: str, headers: dict[str, str], body: Optional[bytes] = None) -> Response:
    """``url``'s answer, streamed as it comes; the upstream connection closes when the browser leaves."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None))
    try:
        upstream = await client.send(client.build_request(method, url, headers=headers, content=body), stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        return JSONResponse({"error": {"message": f"cannot reach {url}: {exc}", "type": "BadGatewayError",
                                       "param": None, "code": 502}}, status_code=502)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await client.aclose()
    return StreamingResponse(chunks(), status_code=upstream.status_code, headers=NO_CACHE,
                             media_type=upstream.headers.get("content-type"))


def build_view_app(layout: FleetLayout) -> FastAPI:
    history = RoutingHistory(layout.replicas)

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        followers = [asyncio.ensure_future(history.follow(i)) for i in range(len(layout.replicas))]
        yield
        for task in followers:
            task.cancel()
        for task in followers:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="minipaged fleet", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.history = history

    @app.get("/")
    async def page() -> HTMLResponse:
        return HTMLResponse(web.fleet_html(), headers={"Cache-Control": "no-cache"})

    @app.get("/web/{name}")
    async def page_file(name: str) -> Response:
        found = web.static_file(name)
        if found is None:
            return JSONResponse({"error": {"message": f"no file {name!r} in the fleet view; open / for the page."}},
                                status_code=404)
        return Response(found[0], media_type=found[1], headers={"Cache-Control": "no-cache"})

    @app.get("/fleet.json")
    async def fleet() -> dict[str, Any]:
        return layout.as_json()

    @app.get("/landed.json")
    async def landed() -> dict[str, Any]:
        """Where the router sent each recent request (newest first), for a page that opens late."""
        return history.as_json()

    @app.get("/replica/{index}/v1/events")
    async def events(index: int, request: Request) -> Response:
        if not 0 <= index < len(layout.replicas):
            return JSONResponse({"error": {"message": f"no replica {index}: the fleet has "
                                                      f"{len(layout.replicas)} (0 to {len(layout.replicas) - 1})."}},
                                status_code=404)
        headers = {"Accept-Encoding": "identity"}       # relayed as bytes: no encoding to undo or to forward
        if "authorization" in request.headers:
            headers["Authorization"] = request.headers["authorization"]
        return await relay("GET", layout.replicas[index].url + "/v1/events", headers)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED_HEADERS}
        return await relay("POST", layout.router_url + "/v1/chat/completions",
                           {**headers, "Accept-Encoding": "identity"}, await request.body())

    return app
