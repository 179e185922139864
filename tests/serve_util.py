"""A real ``minipaged serve`` subprocess on 127.0.0.1 with a free port, for tests; it always stops."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from typing import Iterator

import httpx

START_TIMEOUT_S = 90.0          # importing torch and transformers is slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_answer(proc: subprocess.Popen, url: str, what: str, log_path: str) -> None:
    """Poll ``url`` until it answers 200; fail with ``what``'s log if the process exits or is too slow."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{open(log_path).read()}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {START_TIMEOUT_S} s:\n{open(log_path).read()}")
        time.sleep(0.2)


@contextmanager
def running_server(model: str, *flags: str, log_path: str) -> Iterator[str]:
    """Start ``minipaged serve --model MODEL FLAGS``; yields its base URL once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "minipaged", "serve", "--model", model, "--port", str(port),
                                 "--threads", "1", *flags], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_answer(proc, url + "/health", "the server", log_path)
        yield url
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited after ``grace_s``."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def wait_until_idle(url: str, timeout: float = 10.0) -> dict:
    """Poll /health until nothing runs or waits; returns the last health record."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health", timeout=2.0).json()
        if health["num_requests_running"] == 0 and health["num_requests_waiting"] == 0:
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is still busy after {timeout} s: {health}")
        time.sleep(0.05)


@contextmanager
def running_classroom(attach: str, *, log_path: str) -> Iterator[str]:
    """Start ``minipaged classroom --attach ATTACH`` on a free port; yields its page URL once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "minipaged", "classroom", "--attach", attach,
                                 "--port", str(port), "--public-url", url], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)      # its own process group: see the end
    try:
        wait_for_answer(proc, url + "/", "the classroom", log_path)
        yield url
    finally:
        stop_process(proc)
        # textual-serve runs each page's app as `sh -c "python -m minipaged watch ..."` and does not stop
        # them when it is terminated; whatever is left of the group goes with it.
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
