"""Start a server to benchmark, wait until it answers, and always stop it: ``minipaged serve`` or a peer.

``bench serve`` itself only needs a URL; the tuning walkthrough (``bench/tuning.py``), the peer comparison
(``bench/peer.py``) and the tests start real servers on 127.0.0.1 with a free port, one at a time, and read
their Prometheus counters around a run. A server that exits or does not answer in time fails with its log,
rather than leaving the caller waiting.
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional

START_TIMEOUT_S = 90.0          # importing torch and transformers is slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_answer(proc: subprocess.Popen, url: str, what: str, log_path: str,
                    timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll ``url`` until it answers 200; fail with ``what``'s log if the process exits or is too slow."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{open(log_path).read()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout_s} s:\n{open(log_path).read()}")
        time.sleep(0.2)


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextmanager
def running(command: list[str], port: int, *, what: str, log_path: str, env: Optional[dict[str, str]] = None,
            health_path: str = "/health", timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Run ``command`` (a server listening on ``port``); yields its base URL once ``health_path`` answers."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_answer(proc, url + health_path, what, log_path, timeout_s)
        yield url
    finally:
        stop_process(proc)


def minipaged_serve_command(model: str, port: int, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "minipaged", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", str(port), *flags]


def transformers_serve_command(model_dir: str, port: int, flags: list[str]) -> list[str]:
    """``transformers serve`` pinned to one local model folder (no hub needed), on the CPU."""
    return [sys.executable, "-m", "transformers.cli.transformers", "serve", model_dir, "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), *flags]


def metric_totals(url: str) -> dict[str, float]:
    """The server's /metrics samples summed over labels, by name ({} when it has no /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    response = httpx.get(url + "/metrics", timeout=5)
    if response.status_code != 200:
        return {}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


__all__ = ["free_port", "wait_for_answer", "stop_process", "running", "minipaged_serve_command",
           "transformers_serve_command", "metric_totals"]
