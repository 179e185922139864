"""A real ``minipaged serve`` subprocess on 127.0.0.1 with a free port, for tests; it always stops."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Iterator

import httpx

START_TIMEOUT_S = 90.0          # importing torch and transformers is slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{open(log_path).read()}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer within {START_TIMEOUT_S} s:\n{open(log_path).read()}")
            time.sleep(0.2)
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
