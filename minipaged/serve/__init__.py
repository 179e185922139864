"""``minipaged serve``: an OpenAI-compatible server over one engine, with /metrics and a live event stream.

Pieces: ``protocol`` (the OpenAI request and response shapes, the limits), ``async_engine`` (the one engine
thread and a queue per request), ``api_server`` (the FastAPI routes), ``http_guards`` (body limit, HEAD),
``liveness`` (heartbeat and goodbye on the event stream), ``shutdown`` (drain on SIGTERM). FastAPI and uvicorn are imported only when the
server runs, so other commands do not pay for them.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from minipaged.options import add_engine_arguments, build_engine, engine_options

DEFAULT_HOST = "127.0.0.1"        # reachable from this machine only, unless --host says otherwise
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING = 256
DEFAULT_EVENT_HEARTBEAT_S = 5.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: no key)%(default).0s")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the --model value)%(default).0s")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING,
                   help="answer 503 with Retry-After when this many samples (n counts) already wait for admission")
    from .limits import ServerLimits, limit_names
    limits = ServerLimits()
    for name in limit_names():
        default = getattr(limits, name)
        g.add_argument(ServerLimits.flag(name), dest=name, type=type(default), default=default,
                       help=ServerLimits.HELP[name])
    g.add_argument("--event-heartbeat-s", type=float, default=DEFAULT_EVENT_HEARTBEAT_S,
                   help="/v1/events sends a ': heartbeat' comment after this many seconds without an event")
    g.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                   help="on SIGTERM, how many seconds running requests may go on before they are ended with an "
                        "error (new requests get 503 meanwhile)")
    g.add_argument("--event-buffer-mb", type=float, default=4.0,
                   help="a /v1/events watcher (a browser, watch --attach) with this much unsent is dropped; it "
                        "reconnects from a fresh snapshot")
    add_engine_arguments(parser)


def flag_problem(args: argparse.Namespace) -> Optional[str]:
    """Server flags that cannot work, caught before the model loads."""
    from .limits import ServerLimits, limit_names
    for name in ("max_waiting_requests", *limit_names()):
        value = getattr(args, name, None)
        if value is not None and not value > 0:
            flag = ServerLimits.FLAGS.get(name, f"--{name.replace('_', '-')}")
            return f"{flag} must be {'positive' if isinstance(value, float) else 'at least 1'}, not {value}."
    for name in ("event_heartbeat_s", "shutdown_timeout", "event_buffer_mb"):
        if getattr(args, name) <= 0 and not (name == "shutdown_timeout" and args.shutdown_timeout == 0):
            return f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}."
    return None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .api_server import ServerSettings, build_app
    from .limits import ServerLimits, limit_names
    from .shutdown import DrainingServer

    problem = flag_problem(args)
    if problem:
        print(f"minipaged serve: {problem}", file=sys.stderr)
        return 2
    engine = build_engine(args.model, engine_options(args), progress=lambda m: print(m, file=sys.stderr))
    limits = ServerLimits(**{name: getattr(args, name) for name in limit_names()})
    engine.logits.compiler.timeout_s = limits.grammar_timeout_s
    settings = ServerSettings(served_model_name=args.served_model_name or args.model, api_key=args.api_key,
                              max_waiting_requests=args.max_waiting_requests, limits=limits,
                              event_heartbeat_s=args.event_heartbeat_s, shutdown_timeout_s=args.shutdown_timeout,
                              event_buffer_bytes=max(1, int(args.event_buffer_mb * (1 << 20))))
    app = build_app(engine, settings)
    print(f"minipaged serve: {settings.served_model_name} on http://{args.host}:{args.port} "
          f"(OpenAI API under /v1, metrics at /metrics, events at /v1/events, "
          f"the live view at /)", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning",
                            timeout_graceful_shutdown=2)
    DrainingServer(config, drain=app.state.drain).run()
    print("minipaged serve: stopped", file=sys.stderr, flush=True)
    return 0


__all__ = ["add_serve_arguments", "run_serve"]
