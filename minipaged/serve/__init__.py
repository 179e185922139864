"""``minipaged serve``: an OpenAI-compatible server over one engine, with /metrics and a live event stream.

Pieces: ``protocol`` (the OpenAI request and response shapes), ``async_engine`` (the one engine thread and
a queue per request), ``api_server`` (the FastAPI routes). FastAPI and uvicorn are imported only when the
server runs, so other commands do not pay for them.
"""
from __future__ import annotations

import argparse
import sys

from minipaged.options import add_engine_arguments, build_engine, engine_options

DEFAULT_HOST = "127.0.0.1"        # reachable from this machine only, unless --host says otherwise
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING = 256


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: no key)%(default).0s")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)%(default).0s")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="answer 503 with Retry-After when this many requests already wait for admission")
    g.add_argument("--event-buffer-mb", type=float, default=4.0,
                   help="a /v1/events watcher (a browser, watch --attach) with this much unsent is dropped; it "
                        "reconnects from a fresh snapshot")
    add_engine_arguments(parser)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api_server import ServerSettings, build_app

    if args.max_waiting_requests is not None and args.max_waiting_requests < 1:
        print(f"minipaged serve: --max-waiting-requests must be at least 1, not {args.max_waiting_requests}.",
              file=sys.stderr)
        return 2
    engine = build_engine(args.model, engine_options(args), progress=lambda m: print(m, file=sys.stderr))
    settings = ServerSettings(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                              max_waiting_requests=args.max_waiting_requests,
                              event_buffer_bytes=max(1, int(args.event_buffer_mb * (1 << 20))))
    app = build_app(engine, settings)
    print(f"minipaged serve: {settings.served_model_name} on http://{args.host}:{args.port} "
          f"(OpenAI API under /v1, metrics at /metrics, events at /v1/events, the live view at /)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                timeout_graceful_shutdown=2)
    return 0


__all__ = ["add_serve_arguments", "run_serve"]
