"""Thirty students and one adversary on one ``minipaged serve`` (issue 48 item 6: a soak test, not CI).

A class of 30 simulated students runs throughout (short streaming chats with pauses, page prompts, a few
``/v1/events`` watchers, some aborting mid-stream by closing the connection), plus one victim stream decoding
throughout. One adversary runs each row of issue 48's table in turn. Per row it records what issue 48's targets
name: the victim's longest pause between two streamed chunks, ``/health``'s slowest answer (polled from
127.0.0.1 every 0.25 s), the adversary's status codes (2xx or an OpenAI-shaped error expected), the server's RSS
(the API server and its children: the engine core) before and after; at the end, whether every KV block is free.

Every client binds its own loopback address (127.0.0.10-39 the students, .50-52 the watchers, .100 the victim,
.200 the adversary, 127.0.1.x the idle event streams), so the server sees a class on one network: 127.0.0.1 (the
health poll) is "this machine", with no share to keep to. The victim and the health poll run in a process of
their own, so that the GIL of the students' and the adversary's process (a 50 MB stream being parsed) is not
counted as the server's pause; all the clients still share the machine's cores with the server. The rows are
scaled so that the whole run takes a few minutes on a 2-core machine (each row also stops at ``ROW_LIMIT_S``,
or its own ``ROW_LIMITS_S``, closing its connections); ``SCALING`` says how each differs from the issue's.

    python bench/soak.py [--model smollm2 | --tiny] [--rows "slowloris;..." --save-as NAME]

``--rows`` runs only the rows named (a case's before/after, as bench/out/soak_*_before.json and _after.json), with
the class throughout as in the whole run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import subprocess
import tempfile
import threading
import time
from collections import Counter
from typing import Any, Callable, Optional

import httpx

from minipaged.bench.report import markdown_table, save
from minipaged.bench.servers import free_port, minipaged_serve_command, stop_process, wait_for_answer
from minipaged.config import LONG_PREFILL_CPU

STUDENTS, WATCHERS = 30, 3
ROW_LIMIT_S = 45.0                  # an adversary still at it after this closes its connections
# Rows whose adversary is served, more slowly, beside the class (fair share) and needs longer to get its answer.
ROW_LIMITS_S = {"n=128 long prompt": 120.0, "cached prefix": 120.0}
SETTLE_S = 2.0                      # before and after each row: the pauses and RSS of its aftermath count too
ADVERSARY, VICTIM = "127.0.0.200", "127.0.0.100"
TARGETS = {"victim_pause_s": 1.0, "health_s": 1.0, "rss_growth_mb": 200.0}
SCALING = {
    "page prompt": "3 MB of text, sent 3 times (a few MB)",
    "7.5 MB completion": "as the issue: 7.5 MB of text in one /v1/completions prompt",
    "16 long prefills": "16 prompts of the long-prefill threshold (128 token ids) at once, 16 tokens each",
    "cached prefix": "a prefix of min(3,000, context - 300) tokens cached, then 12 requests of it + 120 new tokens; "
                     "the row ends at 120 s, not 45",
    "n=128 long prompt": "n = min(128, --max-n) samples of a 1,000-token prompt (1,500 x 128 is past the client's "
                         "131,072 prompt-token quota: a 400), 16 tokens each; the row ends at 120 s, not 45",
    "logprobs, paused then resumed": "n = 128 x 300 tokens with logprobs=20 (the issue: 1,200), paused 8 s, resumed",
    "logprobs at the bound, paused then resumed": "the largest that --max-output-logprobs (131,072 entries) lets "
                                                  "through: n = 128 x 48 tokens with logprobs=20, paused 8 s, resumed",
    "paused reader": "n = 128 x 1,500 tokens, not read for 15 s, then closed",
    "slowloris": "as the issue: 1,100 connections, a header line every 5 s for 15 s",
    "240 idle watchers": "240 /v1/events streams from 240 addresses, never read, held 15 s",
    "tiny requests": "2,000 one-token requests 500 at a time (the issue: 10,000)",
    "7 MB bodies": "3 bodies of 7 MB (1.2 million token ids) at once",
}


# ---------------------------------------------------------------------------------------------- the server's memory
def rss_mb(pid: int) -> float:
    """VmRSS of ``pid`` and all its descendants (the API server and the engine core process), in MB."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
        except (OSError, StopIteration):
            pass
    return total


def tcp_memory_mb() -> float:
    """The kernel's TCP buffer memory (/proc/net/sockstat ``mem``, in pages): idle streams pinned ~800 MB of it."""
    with open("/proc/net/sockstat") as f:
        for line in f:
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("mem") + 1]) * resource.getpagesize() / 2 ** 20
    return float("nan")


# ---------------------------------------------------------------------------------------------- clients
def client(address: str, timeout: float = 60.0) -> httpx.Client:
    """A client whose connections come from ``address`` (a loopback address: one student to the server)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=timeout)


def openai_shaped(response: httpx.Response) -> bool:
    """An OpenAI error body: ``{"error": {"message": ..., "type": ...}}``."""
    try:
        error = response.json().get("error")
        return isinstance(error, dict) and "message" in error and "type" in error
    except (ValueError, AttributeError):
        return False


class Codes:
    """Status codes seen, thread-safe; a non-2xx that is not OpenAI-shaped is counted apart."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def add(self, response: Optional[httpx.Response] = None, label: Optional[str] = None, count: int = 1) -> None:
        if label is None and response is not None:
            label = str(response.status_code)
            if response.status_code >= 400:
                if not response.is_closed:
                    response.read()
                label += "" if openai_shaped(response) else " (not OpenAI-shaped)"
        with self.lock:
            self.counts[label or "?"] += count

    def summary(self) -> str:
        return summary(self.counts)


class FirstTokens:
    """When each student's chat was sent and how long its first token took (thread-safe): a row's slowest,
    chats still waiting at the row's end counted as waiting until then, tells whether new students were served."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done: list[tuple[float, float]] = []       # (sent, seconds to the first token)
        self.pending: dict[int, float] = {}             # a chat's key -> when it was sent

    def sent(self, key: int) -> None:
        with self.lock:
            self.pending[key] = time.monotonic()

    def answered(self, key: int) -> None:
        with self.lock:
            if (sent := self.pending.pop(key, None)) is not None:
                self.done.append((sent, time.monotonic() - sent))

    def gone(self, key: int) -> None:
        with self.lock:
            self.pending.pop(key, None)

    def slowest(self, since: float, until: float) -> float:
        """The slowest first token of the chats sent between ``since`` and ``until`` (or waiting then)."""
        with self.lock:
            waits = [wait for sent, wait in self.done if since <= sent <= until]
            waits += [until - sent for sent in self.pending.values() if sent <= until]
        return max(waits, default=float("nan"))


def summary(counts: Counter[str]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "-"


def observe(url: str, max_tokens: int, victim_path: str, health_path: str) -> None:
    """The victim's stream and the /health poll, in a process of their own (``Observer``): in the process of the
    students and the adversary, that process's GIL (an adversary parsing a 50 MB stream) would show up as the
    server's pause. Times are ``time.monotonic()``, one clock for every process on Linux."""
    def victim() -> None:
        with client(VICTIM, timeout=600) as http, open(victim_path, "w", buffering=1) as out:
            while True:
                out.write("N\n")                           # a new stream: no pause spans two
                body = {"prompt": "a long story", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
                try:
                    with http.stream("POST", url + "/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                out.write(f"C {time.monotonic()}\n")
                except httpx.HTTPError:
                    time.sleep(0.5)

    threading.Thread(target=victim, daemon=True).start()
    with httpx.Client(timeout=120) as http, open(health_path, "w", buffering=1) as out:
        while True:
            sent = time.monotonic()
            out.write(f"S {sent}\n")
            try:
                status = str(http.get(url + "/health").status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            out.write(f"A {sent} {time.monotonic() - sent} {status}\n")
            time.sleep(0.25)


class Observer:
    """Runs ``observe`` in a child process and reads what it wrote: the victim's pauses, /health's answers."""

    def __init__(self, url: str, max_tokens: int, folder: str) -> None:
        import multiprocessing
        self.victim_path, self.health_path = os.path.join(folder, "victim.txt"), os.path.join(folder, "health.txt")
        self.process = multiprocessing.get_context("spawn").Process(
            target=observe, args=(url, max_tokens, self.victim_path, self.health_path), daemon=True)
        self.process.start()

    def stop(self) -> None:
        self.process.terminate()
        self.process.join(10)

    def streams(self) -> list[list[float]]:
        streams: list[list[float]] = []
        with open(self.victim_path) as f:
            for line in f:
                if line.startswith("N"):
                    streams.append([])
                elif line.startswith("C ") and line.endswith("\n") and streams:
                    streams[-1].append(float(line[2:]))
        return streams

    def chunks(self) -> int:
        return sum(len(stream) for stream in self.streams())

    def longest_pause(self, since: float, until: float) -> float:
        """The longest gap between two chunks of one stream that ends inside [since, until] (a gap that began
        before ``since`` counts: the row may have caused it), or the current stream's gap if it has not ended."""
        streams, worst = self.streams(), 0.0
        for times in streams:
            worst = max([worst] + [b - a for a, b in zip(times, times[1:]) if since <= b <= until])
        if streams and streams[-1]:
            worst = max(worst, time.monotonic() - streams[-1][-1])
        return worst

    def slowest_health(self, since: float, until: float) -> float:
        """/health's slowest answer to a poll sent in [since, until]; a poll not answered yet counts as so far."""
        pending: dict[float, float] = {}
        answered: list[float] = []
        with open(self.health_path) as f:
            for line in f:
                fields = line.split()
                if line.endswith("\n") and fields[0] == "S":
                    pending[float(fields[1])] = time.monotonic() - float(fields[1])
                elif line.endswith("\n") and fields[0] == "A":
                    pending.pop(float(fields[1]), None)
                    if since <= float(fields[1]) <= until:
                        answered.append(float(fields[2]))
        return max(answered + list(pending.values()), default=float("nan"))


class Student(threading.Thread):
    """A student: short streaming chats with pauses between, sometimes a page prompt, sometimes an abort."""

    def __init__(self, url: str, address: str, stop: threading.Event, codes: Codes, first_tokens: FirstTokens,
                 seed: int) -> None:
        super().__init__(daemon=True)
        self.url, self.address, self.stop, self.codes, self.rng = url, address, stop, codes, random.Random(seed)
        self.first_tokens = first_tokens

    def run(self) -> None:
        with client(self.address) as http:
            while not self.stop.is_set():
                roll = self.rng.random()
                try:
                    if roll < 0.15:
                        body = {"prompt": f"Tell me about topic {self.rng.randrange(100)}", "max_tokens": 24}
                        self.codes.add(http.post(self.url + "/v1/page/prompt", json=body))
                    else:
                        self.chat(http, abort_after=3 if roll < 0.25 else None)
                except httpx.HTTPError as exc:
                    self.codes.add(label=type(exc).__name__)
                self.stop.wait(self.rng.uniform(1.0, 3.0))

    def chat(self, http: httpx.Client, abort_after: Optional[int]) -> None:
        body = {"messages": [{"role": "user", "content": f"Explain idea {self.rng.randrange(1000)} briefly."}],
                "max_tokens": self.rng.randint(16, 48), "stream": True}
        key = id(body)
        self.first_tokens.sent(key)
        try:
            with http.stream("POST", self.url + "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    self.codes.add(response)
                    return
                chunks = 0
                for line in response.iter_lines():
                    chunks += line.startswith("data: {")
                    if chunks == 1:
                        self.first_tokens.answered(key)
                    if abort_after is not None and chunks >= abort_after:
                        self.codes.add(label="aborted (closed)")      # leaving the block closes the connection
                        return
                self.codes.add(response)
        finally:
            self.first_tokens.gone(key)


def watcher(url: str, address: str, stop: threading.Event) -> None:
    """A page watching /v1/events, reading everything, reconnecting when dropped."""
    with client(address, timeout=30) as http:
        while not stop.is_set():
            try:
                with http.stream("GET", url + "/v1/events") as response:
                    for _ in response.iter_bytes():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                stop.wait(1.0)


# ---------------------------------------------------------------------------------------------- the adversary's rows
class Row:
    """What one row's adversary needs: the URL, its deadline, its codes, the context length."""

    def __init__(self, url: str, max_model_len: int, max_n: int, limit_s: float = ROW_LIMIT_S) -> None:
        self.url, self.max_model_len, self.max_n = url, max_model_len, max_n
        self.codes, self.deadline, self.notes = Codes(), time.monotonic() + limit_s, ""

    def left(self) -> float:
        return max(0.1, self.deadline - time.monotonic())

    def post(self, path: str, body: Any = None, content: Optional[bytes] = None) -> None:
        headers = {"content-type": "application/json"}
        with client(ADVERSARY, timeout=self.left()) as http:
            try:
                self.codes.add(http.post(self.url + path, json=body, content=content, headers=headers))
            except httpx.TimeoutException:
                self.codes.add(label="given up at the row's limit")

    def stream(self, body: dict[str, Any], pause_s: float, resume: bool) -> None:
        """A stream whose reader reads nothing for ``pause_s``, then reads to the end (or closes)."""
        with client(ADVERSARY, timeout=self.left()) as http:
            try:
                with http.stream("POST", self.url + "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.codes.add(response)
                        return
                    time.sleep(min(pause_s, self.left()))
                    if not resume:
                        self.codes.add(label="200 (closed unread)")
                        return
                    error = False
                    for line in response.iter_lines():
                        error |= line.startswith('data: {"error"')
                        if time.monotonic() > self.deadline:
                            self.codes.add(label="200 (closed at the row's limit)")
                            return
                    self.codes.add(label="200, ended with an error event" if error else "200")
            except httpx.TimeoutException:
                self.codes.add(label="given up at the row's limit")


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


def in_parallel(jobs: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def page_prompt(row: Row) -> None:
    for _ in range(3):
        row.post("/v1/page/prompt", {"prompt": "word " * 600_000})


def huge_completion(row: Row) -> None:
    row.post("/v1/completions", {"prompt": "a " * 3_750_000, "max_tokens": 4})


def long_prefills(row: Row) -> None:
    in_parallel([lambda i=i: row.post("/v1/completions", {"prompt": ids(LONG_PREFILL_CPU, i), "max_tokens": 16})
                 for i in range(16)])


def cached_prefix(row: Row) -> None:
    prefix = ids(min(3000, row.max_model_len - 300), 7)
    row.post("/v1/completions", {"prompt": prefix, "max_tokens": 1})
    in_parallel([lambda i=i: row.post("/v1/completions", {"prompt": prefix + ids(120, 100 + i), "max_tokens": 8})
                 for i in range(12)])


def many_samples(row: Row) -> None:
    row.post("/v1/completions", {"prompt": ids(min(1000, row.max_model_len - 100), 11), "n": min(128, row.max_n),
                                 "max_tokens": 16, "temperature": 1.0})


def logprobs_paused(row: Row) -> None:
    row.stream({"prompt": "pause", "n": min(128, row.max_n), "max_tokens": 300, "logprobs": 20, "ignore_eos": True,
                "temperature": 1.0, "stream": True}, pause_s=8.0, resume=True)


def logprobs_at_the_bound(row: Row) -> None:
    row.stream({"prompt": "pause", "n": min(128, row.max_n), "max_tokens": 48, "logprobs": 20, "ignore_eos": True,
                "temperature": 1.0, "stream": True}, pause_s=8.0, resume=True)


def paused_reader(row: Row) -> None:
    row.stream({"prompt": "pause", "n": min(128, row.max_n), "max_tokens": 1500, "ignore_eos": True,
                "temperature": 1.0, "stream": True}, pause_s=15.0, resume=False)


def raw_connections(row: Row, count: int, addresses: Callable[[int], str], request: bytes,
                    hold_s: float, trickle: Optional[bytes]) -> None:
    """``count`` raw connections, each sending ``request``; held for ``hold_s`` (sending ``trickle`` every 5 s);
    what each got back first is counted (nothing, a status line, or closed by the server)."""
    host, port = row.url.removeprefix("http://").split(":")
    held: list[socket.socket] = []
    tcp_before = tcp_memory_mb()
    for i in range(count):
        try:
            s = socket.socket()
            s.bind((addresses(i), 0))
            s.settimeout(5)
            s.connect((host, int(port)))
            s.sendall(request)
            held.append(s)
        except OSError as exc:
            row.codes.add(label=f"connect failed: {exc.strerror or type(exc).__name__}")
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        time.sleep(min(5.0, max(0.0, end - time.monotonic())))
        if trickle:
            for s in held:
                try:
                    s.sendall(trickle)
                except OSError:
                    pass
    tcp_peak = tcp_memory_mb()
    for s in held:
        s.setblocking(False)
        try:
            first = s.recv(64)
            label = first.split(b"\r\n")[0].decode(errors="replace")[9:12] if first else "closed by the server"
        except BlockingIOError:
            label = "held, nothing sent back"
        except OSError as exc:
            label = type(exc).__name__
        row.codes.add(label=label)
        s.close()
    row.notes = f"kernel TCP memory {tcp_before:.0f} -> {tcp_peak:.0f} MB"


def slowloris(row: Row) -> None:
    raw_connections(row, 1100, lambda i: ADVERSARY, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", 15.0,
                    b"X-Slow: 1\r\n")


def idle_watchers(row: Row) -> None:
    request = b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    raw_connections(row, 240, lambda i: f"127.0.1.{i + 1}", request, 15.0, None)


def tiny_requests(row: Row) -> None:
    async def go() -> None:
        transport = httpx.AsyncHTTPTransport(local_address=ADVERSARY)
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
        async with httpx.AsyncClient(transport=transport, limits=limits, timeout=row.left()) as http:
            async def one(i: int) -> None:
                try:
                    body = {"prompt": f"hi {i}", "max_tokens": 1}
                    row.codes.add(await http.post(row.url + "/v1/completions", json=body))
                except httpx.HTTPError as exc:
                    row.codes.add(label=type(exc).__name__)
            for batch in range(4):
                if time.monotonic() > row.deadline:
                    row.codes.add(label="not sent (past the row's limit)", count=500 * (4 - batch))
                    break
                await asyncio.gather(*(one(batch * 500 + i) for i in range(500)))
    asyncio.run(go())


def big_bodies(row: Row) -> None:
    body = ('{"prompt": [' + ",".join(["12345"] * 1_200_000) + '], "max_tokens": 4}').encode()
    in_parallel([lambda: row.post("/v1/completions", content=body) for _ in range(3)])


ROWS: dict[str, Callable[[Row], None]] = {
    "none (5 s, the class alone)": lambda row: time.sleep(5.0),
    "page prompt": page_prompt, "7.5 MB completion": huge_completion, "16 long prefills": long_prefills,
    "cached prefix": cached_prefix, "n=128 long prompt": many_samples,
    "logprobs, paused then resumed": logprobs_paused,
    "logprobs at the bound, paused then resumed": logprobs_at_the_bound,
    "paused reader": paused_reader, "slowloris": slowloris,
    "240 idle watchers": idle_watchers, "tiny requests": tiny_requests, "7 MB bodies": big_bodies,
}


# ---------------------------------------------------------------------------------------------- the run
def wait_idle(url: str, timeout_s: float) -> dict[str, Any]:
    """/health once nothing runs or waits (or at ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/health", timeout=30).json()
        if (health["num_requests_running"] == 0 and health["num_requests_waiting"] == 0) \
                or time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def soak(url: str, pid: int, folder: str, rows_wanted: list[str]) -> dict[str, Any]:
    info = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    max_model_len = int(info["max_model_len"])
    stop, codes, first_tokens = threading.Event(), Codes(), FirstTokens()
    observer = Observer(url, min(2000, max_model_len - 16), folder)
    threads: list[threading.Thread] = [Student(url, f"127.0.0.{10 + i}", stop, codes, first_tokens, seed=i)
                                   for i in range(STUDENTS)]
    threads += [threading.Thread(target=watcher, args=(url, f"127.0.0.{50 + i}", stop), daemon=True)
                for i in range(WATCHERS)]
    rss_start, load = rss_mb(pid), os.getloadavg()[0]
    for t in threads:
        t.start()
    time.sleep(5.0)                       # the class warms up
    while observer.chunks() < 10:
        time.sleep(0.1)
    rows: list[dict[str, Any]] = []
    for name in rows_wanted:
        adversary = ROWS[name]
        time.sleep(SETTLE_S)
        row = Row(url, max_model_len, 128, ROW_LIMITS_S.get(name, ROW_LIMIT_S))
        rss_before, students_before, start = rss_mb(pid), Counter(codes.counts), time.monotonic()
        adversary(row)
        end = time.monotonic()
        rss_peak = rss_mb(pid)
        time.sleep(SETTLE_S)
        until = time.monotonic()
        rows.append({"row": name, "scaling": SCALING.get(name, ""), "seconds": round(end - start, 1),
                     "victim_longest_pause_s": round(observer.longest_pause(start, until), 3),
                     "health_slowest_s": round(observer.slowest_health(start, until), 3),
                     "students_slowest_first_token_s": round(first_tokens.slowest(start, until), 3),
                     "adversary_codes": row.codes.summary(), "notes": row.notes,
                     "student_codes": summary(Counter(codes.counts) - students_before),
                     "rss_before_mb": round(rss_before, 1), "rss_at_end_mb": round(rss_peak, 1),
                     "rss_after_mb": round(rss_mb(pid), 1)})
        print(json.dumps(rows[-1]), flush=True)
    stop.set()
    observer.stop()
    for t in threads:
        t.join(30)
    end_health = wait_idle(url, 120)
    return {"rows": rows, "students": STUDENTS, "watchers": WATCHERS, "student_codes": codes.summary(),
            "load_average_at_start": load,
            "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_mb(pid), 1), "health_at_end": end_health,
            "all_blocks_free": end_health["blocks_free"] == end_health["blocks_total"], "row_limit_s": ROW_LIMIT_S,
            "row_limits_s": {name: ROW_LIMITS_S[name] for name in rows_wanted if name in ROW_LIMITS_S},
            "targets": TARGETS, "rows_run": rows_wanted}


def markdown(record: dict[str, Any]) -> str:
    nan = float("nan")
    def verdict(value: float, target: float) -> str:
        return f"{value:.2f}" + ("" if value <= target else " (over)")
    table = markdown_table(
        ["what the adversary did", "for (s)", "victim's longest pause (s)", "/health's slowest answer (s)",
         "students' slowest first token (s)", "adversary's answers", "students' answers",
         "server RSS before -> after (MB)"],
        [[r["row"], r["seconds"], verdict(r["victim_longest_pause_s"], TARGETS["victim_pause_s"]),
          verdict(r["health_slowest_s"], TARGETS["health_s"]), f"{r.get('students_slowest_first_token_s', nan):.2f}",
          r["adversary_codes"] + (f"; {r['notes']}" if r["notes"] else ""), r["student_codes"],
          f"{r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f}"] for r in record["rows"]])
    h = record["health_at_end"]
    growth = record["rss_end_mb"] - record["rss_start_mb"]
    free = "all" if record["all_blocks_free"] else "NOT all"
    return (f"{record['model']}, {record['students']} students + {record['watchers']} watchers + a victim stream "
            f"throughout (load average {record['load_average_at_start']:.1f} at the start, on {os.cpu_count()} cores "
            f"that the clients share with the server); targets (issue 48): pause <= 1 s, /health <= 1 s, RSS "
            f"growth <= 200 MB, every block free.\n\n{table}\n\nStudents' answers over the run: "
            f"{record['student_codes']}.\n\n"
            f"Server RSS {record['rss_start_mb']:.0f} -> {record['rss_end_mb']:.0f} MB over the run "
            f"({growth:+.0f} MB); KV blocks free at the end: {h['blocks_free']} of {h['blocks_total']} ({free}).\n\n"
            "Scaling: " + "; ".join(f"{k}: {v}" for k, v in SCALING.items()
                                    if k in record.get("rows_run", SCALING)) + ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tiny", action="store_true", help="a tiny random checkpoint (a quick run)")
    ap.add_argument("--rows", default=";".join(ROWS), help="the rows to run, separated by ';' (default: all)")
    ap.add_argument("--save-as", default=None, help="the result's name in bench/out (default: soak, soak_tiny)")
    ap.add_argument("--serve-flags", default="", help="more flags for minipaged serve (a case's before/after)")
    args = ap.parse_args()
    rows_wanted = [r.strip() for r in args.rows.split(";") if r.strip()]
    unknown = [r for r in rows_wanted if r not in ROWS]
    if unknown:
        ap.error(f"no such row: {unknown}; the rows are: {list(ROWS)}")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4096)), hard))   # 1,100 + 240 sockets here
    if args.tiny:
        from minipaged.model.testing import build_tiny_llama
        args.model = str(build_tiny_llama(tempfile.mkdtemp(prefix="soak-"), tie_word_embeddings=True))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "serve.log")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(minipaged_serve_command(args.model, port, ["--threads", "1",
                                                                                *args.serve_flags.split()]), stdout=log,
                                    stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_answer(proc, url + "/health", "minipaged serve", log_path)
            record = soak(url, proc.pid, tmp, rows_wanted)
        finally:
            stop_process(proc)
    record["model"] = "tiny random Llama" if args.tiny else args.model
    record["serve_flags"] = args.serve_flags
    save(args.save_as or ("soak_tiny" if args.tiny else "soak"), record, markdown(record))


if __name__ == "__main__":
    main()
