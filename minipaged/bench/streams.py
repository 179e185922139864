"""Many streaming clients against one server, and the CPU time each of its processes spent on them.

What ``bench/serve.py`` measures round after round, and what lesson 12 ("Why vLLM runs its engine in its own
process") runs once per variant: every prompt streamed at once through ``/v1/completions`` (token ids in,
greedy, ``ignore_eos``), the server's CPU seconds read from ``/proc`` by process id (its engine core's, a
child process under ``minipaged serve``, apart from the API server's), and the clients' own.

CPU time, unlike wall time, is not inflated by other work on a shared machine: it says what each process
spent on the same tokens.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, NamedTuple


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) process ``pid`` and its children (the server's engine core) have
    used: unlike wall time, other work on a shared machine does not inflate it."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(child) for child in children(pid))


def children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def pid_of_server(port: int) -> int:
    """The process of the server started on ``port`` (its command line names the port)."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if b"serve" in args and str(port).encode() in args and b"--port" in args:
            return int(entry)
    raise RuntimeError(f"no server process found for port {port}")


class StreamResult(NamedTuple):
    ttft_s: float          # request sent -> first streamed chunk, on the client's clock
    tokens: int            # completion tokens, from the last chunk's usage
    request_id: str        # the id the server gave it (its step events carry the same id)


def completion_request(host: str, port: int, model: str, prompt: list[int], max_tokens: int) -> bytes:
    """The HTTP/1.1 request of one streamed completion (token ids in, greedy, ``ignore_eos``), as bytes."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode() + body


def unchunk(body: bytes) -> bytes:
    """The payload of an HTTP/1.1 ``Transfer-Encoding: chunked`` body (size line, data, CRLF; a 0 ends it)."""
    out, at = [], 0
    while True:
        line_end = body.index(b"\r\n", at)
        size = int(body[at:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[line_end + 2:line_end + 2 + size])
        at = line_end + 2 + size + 2


async def one_client(host: str, port: int, model: str, prompt: list[int], max_tokens: int) -> StreamResult:
    """One streamed request, read to its end, over a bare asyncio connection.

    A lean reader on purpose: in a real deployment the clients run on other machines, here they share the
    server's two cores, so every microsecond a client spends is taken from the server. httpx spent about as
    much CPU per token as the server itself (its chunk and line parsing in Python, per token). This reader
    only appends what arrives; the first bytes of an SSE event are the TTFT, and the body is parsed once, at
    the end, for the id the server gave and the usage's token count."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(completion_request(host, port, model, prompt, max_tokens))
        parts, ttft = [], None
        while True:
            data = await reader.read(65536)
            if not data:
                break
            parts.append(data)
            if ttft is None and b"data: " in data:
                ttft = time.perf_counter() - start
    finally:
        writer.close()
    raw = b"".join(parts)
    head, _, body = raw.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0]
    if status.split(b" ")[1:2] != [b"200"]:
        raise RuntimeError(f"the server answered {status.decode(errors='replace')}: {body[:300]!r}")
    if b"transfer-encoding: chunked" in head.lower():
        body = unchunk(body)
    events = [line[len(b"data: "):] for line in body.split(b"\n") if line.startswith(b"data: {")]
    if not events:
        raise RuntimeError(f"the stream carried no events: {body[:300]!r}")
    usage = json.loads(events[-1]).get("usage") or {}
    return StreamResult(ttft or float("nan"), int(usage.get("completion_tokens", 0)), json.loads(events[0])["id"])


@dataclass
class ServedRound:
    """All prompts streamed at once through one server: wall seconds, what each client got, and CPU seconds."""

    seconds: float
    results: list[StreamResult]          # in the prompts' order
    server_cpu_s: float                  # the server's processes together
    core_cpu_s: float                    # its engine core's process (0 under --core-in-thread: one process)
    clients_cpu_s: float                 # this process, where the clients ran
    warm_up_id: str                      # the warm-up request's id (its steps come before the round's)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.results)

    @property
    def mean_ttft_s(self) -> float:
        return statistics.mean(r.ttft_s for r in self.results)

    @property
    def api_server_cpu_s(self) -> float:
        return self.server_cpu_s - self.core_cpu_s


async def through_server(url: str, model: str, prompts: list[list[int]], max_tokens: int, pid: int) -> ServedRound:
    """Every prompt streamed at once (one warm-up request first, not one of the prompts: no cache hit)."""
    from urllib.parse import urlsplit

    where = urlsplit(url)
    host, port = where.hostname or "127.0.0.1", where.port or 80
    warm = await one_client(host, port, model, [5] * 8, 2)
    cores = children(pid)
    start, cpu, core_cpu = time.perf_counter(), cpu_seconds(pid), sum(map(cpu_seconds, cores))
    clients_cpu = time.process_time()
    results = await asyncio.gather(*[one_client(host, port, model, p, max_tokens) for p in prompts])
    seconds, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    core_cpu, clients_cpu = sum(map(cpu_seconds, cores)) - core_cpu, time.process_time() - clients_cpu
    return ServedRound(seconds, list(results), cpu, core_cpu, clients_cpu, warm.request_id)


def run_to_the_end(coroutine: Any) -> Any:
    """``asyncio.run(coroutine)``, also where this thread already runs an event loop (a Jupyter kernel does, and
    ``asyncio.run`` refuses to start a second one there): the coroutine then runs on a loop of its own in a
    thread, and this call waits for it."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minipaged-streams") as pool:
        return pool.submit(asyncio.run, coroutine).result()


def stream_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, pid: int) -> ServedRound:
    return run_to_the_end(through_server(url, model, prompts, max_tokens, pid))


__all__ = ["cpu_seconds", "children", "pid_of_server", "StreamResult", "completion_request", "unchunk", "one_client", "ServedRound",
           "through_server", "run_to_the_end", "stream_all"]
