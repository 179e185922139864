"""The fleet view's server: one page that draws every replica side by side (``web/static/fleet.html``).

The page cannot read the replicas' ``/v1/events`` itself (another origin, and replicas on other machines may
not be reachable from the browser), so this server relays them: ``/replica/N/v1/events`` is replica N's
stream, byte for byte. The page's prompt box posts to ``/v1/chat/completions`` here, relayed to the router,
so a student's request is routed like any client's and the page sees on which replica it lands. Nothing is
folded here: as in the single-engine view, each browser folds the events itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from minipaged import web

from .replicas import Replica

NO_CACHE = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
FORWARDED_HEADERS = ("content-type", "authorization", "accept")


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
    app = FastAPI(title="minipaged fleet", docs_url=None, redoc_url=None, openapi_url=None)

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
