"""``minipaged fleet``: several engines behind a cache-aware router, and one page that watches them all.

Pieces, one job each: ``replicas`` (start ``minipaged serve`` processes, or take ``--worker-urls``),
``router`` (sglang-router as a process of its own), ``processes`` (everything started, and stopping it by
process group), ``view`` (the fleet page's server, relaying each replica's event stream). The fleet command
itself loads no model: it imports neither torch nor transformers.
"""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_PORT = 30000            # sglang-router's own default
DEFAULT_VIEW_PORT = 30080
DEFAULT_SERVE_ARGS = ""


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    from .router import POLICIES
    parser.add_argument("--replicas", type=int, default=2,
                        help="how many `minipaged serve` replicas to start on this machine (ignored with "
                             "--worker-urls)")
    parser.add_argument("--worker-urls", nargs="+", default=None, metavar="URL",
                        help="use replicas already running (here or on other machines) instead of starting "
                             "them%(default).0s")
    parser.add_argument("--model", default="smollm2", help="the model each started replica serves")
    parser.add_argument("--serve-args", default=DEFAULT_SERVE_ARGS, metavar="ARGS",
                        help="more flags for each started replica, as one string, e.g. \"--num-blocks 256 "
                             "--block-size 16\" (see minipaged serve --help)%(default).0s")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware",
                        help="the router's policy: cache_aware sends a request where its prefix was sent before")
    parser.add_argument("--host", default="127.0.0.1", help="the address the router and the fleet view listen on")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="the router's port: the clients' URL")
    parser.add_argument("--view-port", type=int, default=DEFAULT_VIEW_PORT, help="the fleet view's port")
    parser.add_argument("--log-dir", default=None,
                        help="where each process's log goes (default: a new temporary folder)%(default).0s")


def _raise_interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


def run_fleet(args: argparse.Namespace) -> int:
    from .processes import ChildProcesses
    from .replicas import given_replicas, start_replicas
    from .router import RouterMissing, check_installed, start_router

    try:
        check_installed()
    except RouterMissing as exc:
        print(f"minipaged fleet: {exc}", file=sys.stderr)
        return 2
    if not args.worker_urls and args.replicas < 1:
        print(f"minipaged fleet: --replicas must be at least 1, not {args.replicas}.", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="minipaged-fleet-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    children = ChildProcesses(log_dir)
    signal.signal(signal.SIGTERM, _raise_interrupt)     # SIGTERM unwinds like Ctrl-C: through the finally below
    try:
        if args.worker_urls:
            replicas = given_replicas(args.worker_urls)
        else:
            print(f"minipaged fleet: starting {args.replicas} replicas of {args.model} (logs in {log_dir}) ...",
                  file=sys.stderr, flush=True)
            replicas = start_replicas(children, args.replicas, args.model, args.serve_args)
        router = start_router(children, args.host, args.port, [r.url for r in replicas], args.policy)
        return _serve_view(args, replicas, router.proc.pid)
    except RuntimeError as exc:
        print(f"minipaged fleet: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        children.stop_all()
        print("minipaged fleet: stopped everything it started", file=sys.stderr, flush=True)


def _serve_view(args: argparse.Namespace, replicas: list, router_pid: int) -> int:
    import uvicorn

    from .view import FleetLayout, build_view_app

    router_url = f"http://{args.host}:{args.port}"
    app = build_view_app(FleetLayout(replicas, f"http://127.0.0.1:{args.port}", args.policy, router_pid))
    for i, replica in enumerate(replicas):
        print(f"  replica {i}: {replica.url}", file=sys.stderr)
    print(f"minipaged fleet: clients use {router_url}/v1 (sglang-router, policy {args.policy})\n"
          f"minipaged fleet: the fleet view is at http://{args.host}:{args.view_port}/\n"
          f"Ctrl-C stops the router and every replica it started.", file=sys.stderr, flush=True)
    # Open pages hold relayed event streams: the view gives them 2 s to close on Ctrl-C, then goes on stopping.
    # No forwarded header is believed (as minipaged serve: NO_FORWARDED_HEADERS there), whoever sends one.
    config = uvicorn.Config(app, host=args.host, port=args.view_port, log_level="warning", timeout_graceful_shutdown=2,
                            proxy_headers=False, forwarded_allow_ips="")
    uvicorn.Server(config).run()
    return 0


__all__ = ["add_fleet_arguments", "run_fleet"]
