"""A real ``minipaged serve`` subprocess on 127.0.0.1 with a free port, for tests; it always stops."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from typing import Iterator

import httpx

# free_port, stop_process and wait_for_answer are imported from here by the tests that start other processes
from minipaged.bench.servers import (START_TIMEOUT_S, free_port, minipaged_serve_command, running,  # noqa: F401
                                     stop_process, wait_for_answer)

def gone(pid: int) -> bool:
    """The process has ended (a zombie nobody has reaped yet counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


# What every server the tests start runs with: one thread, and every compiled CPU op (the suite's default in
# process too: conftest.py), so that a server's tokens match an engine's built in the test.
SUITE_FLAGS = ("--threads", "1", "--cpu-ops", "compiled")


@contextmanager
def running_server(model: str, *flags: str, log_path: str) -> Iterator[str]:
    """Start ``minipaged serve --model MODEL FLAGS``; yields its base URL once /health answers."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = minipaged_serve_command(model, port, [*SUITE_FLAGS, *flags])
    with running(command, port, what="the server", log_path=log_path, env=env) as url:
        yield url


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


@contextmanager
def server_process(model: str, *flags: str, log_path: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """Like ``running_server``, but yields (URL, process) for tests that signal the server themselves; a process
    still running at the end is killed."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(minipaged_serve_command(model, port, [*SUITE_FLAGS, *flags]), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_answer(proc, url + "/health", "the server", log_path)
        yield url, proc
    finally:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)          # a frozen one cannot die of SIGTERM
            stop_process(proc, grace_s=5.0)


def victim_stream(url: str, stop, times: list, errors: list) -> None:
    """Another client's stream, kept running until ``stop`` is set (a new one when one ends): each token's arrival
    time goes into ``times``, anything that went wrong into ``errors`` (for the caller to assert: this runs in a
    thread of its own)."""
    import json
    body = {"prompt": "victim", "max_tokens": 1500, "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        while not stop.is_set():
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if "error" in json.loads(line[6:]):
                            raise AssertionError(f"the victim got an error: {line}")
                        times.append(time.monotonic())
                    if stop.is_set():
                        break
    except Exception as exc:          # asserted by the caller
        errors.append(repr(exc))


def openai_client(url: str):
    """The real openai client against a test server: a minute per call, no retries (a retry would hide a 503)."""
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)
