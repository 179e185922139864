"""``minipaged classroom --attach URL``: the attach TUI in students' browsers, through textual-serve.

Each browser that opens the page gets its own ``minipaged watch --attach URL`` process (a thin client: no
torch, tens of MB), all drawing the one shared engine of ``minipaged serve``; each student's prompt box
sends requests to it. textual-serve's page opens a websocket back to ``public_url``, so that address must be
the one students' browsers can reach (the teacher's LAN address, not 127.0.0.1).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Optional

DEFAULT_PORT = 8080


def add_classroom_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--attach", metavar="URL", required=True,
                        help="the `minipaged serve` address every page draws, e.g. http://127.0.0.1:8000%(default).0s")
    parser.add_argument("--api-key", default=None, help="the server's --api-key, if it has one%(default).0s")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address the page is served on (0.0.0.0 lets students' machines in)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port the page is served on")
    parser.add_argument("--public-url", default=None,
                        help="the address students type, e.g. http://192.168.1.20:8080 (default: "
                             "http://HOST:PORT)%(default).0s")


def watch_command(attach: str, api_key: Optional[str] = None) -> str:
    """The command each browser session runs: the attach client, with this very interpreter."""
    words = [sys.executable, "-m", "minipaged", "watch", "--attach", attach]
    return shlex.join(words + (["--api-key", api_key] if api_key else []))


def run_classroom(args: argparse.Namespace) -> int:
    from textual_serve.server import Server

    public_url = args.public_url or f"http://{args.host}:{args.port}"
    print(f"minipaged classroom: students open {public_url} (each page draws {args.attach})", file=sys.stderr,
          flush=True)
    Server(watch_command(args.attach, args.api_key), host=args.host, port=args.port,
           title="minipaged classroom", public_url=public_url).serve()
    return 0


__all__ = ["add_classroom_arguments", "run_classroom", "watch_command"]
