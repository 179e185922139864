"""The replicas: ``minipaged serve`` processes on free loopback ports, or servers already running elsewhere.

Starting them all at once and then waiting for each (rather than one after another) overlaps their slow
part, importing torch and loading the model. A replica that exits or does not answer ``/health`` in time
stops the start-up with its log; the caller then stops the others.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from typing import Optional

from minipaged.bench.servers import START_TIMEOUT_S, free_port, wait_for_answer

from .processes import ChildProcesses


@dataclass(frozen=True)
class Replica:
    """A worker the router sends requests to; ``pid`` is None for a ``--worker-urls`` one (not ours to stop)."""

    url: str
    pid: Optional[int] = None


def serve_command(model: str, port: int, serve_args: str) -> list[str]:
    return [sys.executable, "-m", "minipaged", "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
            *shlex.split(serve_args)]


def start_replicas(children: ChildProcesses, count: int, model: str, serve_args: str,
                   timeout_s: float = START_TIMEOUT_S) -> list[Replica]:
    """Start ``count`` replicas and wait until every one answers ``/health``; raises RuntimeError naming the one
    that failed (with its log)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    started = []
    for i in range(count):
        port = free_port()
        child = children.start(f"replica {i}", serve_command(model, port, serve_args), env=env)
        started.append((child, f"http://127.0.0.1:{port}"))
    for child, url in started:
        wait_for_answer(child.proc, url + "/health", f"{child.name} ({url}, log {child.log_path})",
                        str(child.log_path), timeout_s)
    return [Replica(url, child.proc.pid) for child, url in started]


def given_replicas(urls: list[str]) -> list[Replica]:
    return [Replica(url.rstrip("/")) for url in urls]
