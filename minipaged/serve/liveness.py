"""Liveness of ``GET /v1/events``: a heartbeat while nothing happens, and a goodbye when the server leaves.

A watcher cannot tell an idle server from a dead or frozen one by silence alone, so after ``heartbeat_s``
seconds without a line the stream sends an SSE comment (``: heartbeat``), which every client ignores but
which resets its read timeout. On a graceful shutdown the stream ends with ``event: goodbye``: a stream
that ends without it means the server was lost (``watch --attach`` says so and exits non-zero). The watcher's
stream (``event_hub``) sends both, so that they take the watcher's encoding (gzip) like every event.
"""
from __future__ import annotations

import json

HEARTBEAT = ": heartbeat\n\n"


def goodbye_event(reason: str) -> str:
    return f"event: goodbye\ndata: {json.dumps({'reason': reason})}\n\n"
