"""``minipaged export-html`` and ``minipaged watch --replay FILE --web``: a recorded run as a web page.

Both build the same self-contained page (``minipaged.web.trace_html``); export writes it to a file (it opens
offline, so a lesson's run can be mailed to a class), ``--web`` serves it from a tiny standard-library HTTP
server, for a room whose browsers should all open one address. No torch, no FastAPI: a replay is a thin client.
"""
from __future__ import annotations

import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

from . import trace_html


def export_html(trace_path: str, out_path: Optional[str] = None) -> int:
    """Write the trace's page; returns a command's exit code (2, with a message, if the trace is unreadable)."""
    out = Path(out_path) if out_path else Path(trace_path).with_suffix(".html")
    try:
        html = trace_html(trace_path)
    except (OSError, ValueError) as exc:
        print(f"minipaged export-html: cannot read {trace_path}: {exc}", file=sys.stderr)
        return 2
    out.write_text(html, encoding="utf-8")
    print(f"minipaged export-html: wrote {out} ({len(html) // 1024} KiB, one file: open it in any browser, "
          f"no network needed)", file=sys.stderr)
    return 0


def page_server(html: str, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server answering ``/`` with ``html`` (and 404 elsewhere)."""
    body = html.encode("utf-8")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:          # noqa: N802 (the standard library's name)
            path = self.path.split("?")[0]
            if path not in ("/", "/index.html"):
                self.send_error(404, "only / is served: the replay is one page")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Security-Policy", "frame-ancestors 'none'")   # no other site frames it
            self.send_header("X-Frame-Options", "DENY")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:   # quiet, like `minipaged serve`
            pass

    return ThreadingHTTPServer((host, port), Handler)


def serve_replay(trace_path: str, host: str, port: int) -> int:
    try:
        html = trace_html(trace_path)
    except (OSError, ValueError) as exc:
        print(f"minipaged watch: cannot replay {trace_path}: {exc}", file=sys.stderr)
        return 2
    try:
        server = page_server(html, host, port)
    except OSError as exc:
        print(f"minipaged watch: cannot listen on {host}:{port} ({exc}); choose another with --web-port.",
              file=sys.stderr)
        return 2
    # The server runs in a thread and this one waits for Ctrl-C or SIGTERM through handlers of its own: it stops
    # whenever either arrives, also where it was started with SIGINT ignored (a Ctrl-C that Python's own
    # KeyboardInterrupt would never see) or where the signal lands outside serve_forever's try.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda _signum, _frame: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    serving = threading.Thread(target=server.serve_forever, name="minipaged-replay-page", daemon=True)
    serving.start()
    print(f"minipaged watch: replaying {trace_path} at http://{host}:{port}/ (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
