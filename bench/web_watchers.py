"""The live view's cost to the teacher's machine: `minipaged serve` streaming the same workload with 0 and
with 50 event-stream watchers (and, separately, 50 watchers plus real headless Chromium pages drawing it).

Each phase sends the same 16 streaming requests at once and measures the output throughput the clients see,
the server's peak resident memory, and whether every watcher received every step (the snapshot, then each
step in order, up to the last). The no-watcher phase runs before and after the others, so drift on a busy
machine shows. The watchers are raw HTTP readers in this process (a classroom's browsers run on the
students' machines; here they share the teacher's cores, so the Chromium phase also pays for their drawing).

    python bench/web_watchers.py [--model smollm2] [--watchers 50] [--pages 5]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

import httpx

from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged.bench.requests import random_token_prompts
from minipaged.bench.servers import free_port, minipaged_serve_command, stop_process, wait_for_answer

CLASSROOM_20 = {"pages": 20, "rss_gb": 1.17, "ratio": 47.8 / 64.3}   # textual-serve classroom (issue 25)


class RssSampler:
    """Peak VmRSS of a process over a phase, sampled every 0.1 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            with open(f"/proc/{self.pid}/status") as status:
                kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            self.peak = max(self.peak, kb / 1024)
            time.sleep(0.1)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def one_client(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return tokens


STEP = re.compile(rb'"type":"step","step":(\d+)')


async def watcher(url: str, steps: list[int], ready: asyncio.Event) -> None:
    """Read /v1/events over a raw socket, noting each step number (the snapshot's too): as cheap a reader as
    can be, so that the clients' own work on these shared cores stays small."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"GET /v1/events HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    await writer.drain()
    ready.set()
    tail = b""
    try:
        while data := await reader.read(1 << 16):
            data = tail + data
            end = 0
            for match in STEP.finditer(data):
                steps.append(int(match.group(1)))
                end = match.end()
            tail = data[max(end, len(data) - 64):]
    finally:
        writer.close()


def complete(steps: list[int], last: int) -> bool:
    """The snapshot, then every step after it, up to ``last``."""
    return bool(steps) and steps[-1] == last and steps == list(range(steps[0], last + 1))


async def phase(url: str, prompts: list[list[int]], max_tokens: int, num_watchers: int) -> dict:
    streams: list[list[int]] = [[] for _ in range(num_watchers)]
    readies = [asyncio.Event() for _ in range(num_watchers)]
    tasks = [asyncio.create_task(watcher(url, s, r)) for s, r in zip(streams, readies)]
    for r in readies:
        await r.wait()
    await asyncio.sleep(0.5)                               # every snapshot is in
    async with httpx.AsyncClient(timeout=600) as http:
        start = time.perf_counter()
        tokens = await asyncio.gather(*[one_client(http, url, p, max_tokens) for p in prompts])
        seconds = time.perf_counter() - start
        await asyncio.sleep(0.5)
        last = (await http.get(url + "/health")).json()["steps"]
    await asyncio.sleep(1.0)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"seconds": seconds, "tok_s": sum(tokens) / seconds, "tokens": sum(tokens), "last_step": last,
            "watchers_complete": sum(complete(s, last) for s in streams), "watchers": num_watchers}


class Pages:
    """``n`` tabs of one headless Chromium showing the live view; reports each page's step and drops."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n

    def __enter__(self) -> "Pages":
        command = next((c for c in ("chromium-headless-shell", "chromium") if shutil.which(c)), None)
        if command is None:
            raise SystemExit("no Chromium here: apt-get install chromium-headless-shell (or run with --pages 0)")
        self.profile = tempfile.mkdtemp(prefix="minipaged-bench-")
        self.proc = subprocess.Popen([command, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--disable-background-networking", "--disable-component-update",
                                      "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                                      "--window-size=1400,900", "about:blank"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            time.sleep(0.1)
        self.port = int(port_file.read_text().split()[0])
        self.targets = [httpx.put(f"http://127.0.0.1:{self.port}/json/new?{self.url}/").json() for _ in range(self.n)]
        time.sleep(3)                                      # pages load and connect
        return self

    async def states(self) -> list[dict]:
        import aiohttp
        out = []
        async with aiohttp.ClientSession() as session:
            for target in self.targets:
                async with session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    await ws.send_json({"id": 1, "method": "Runtime.evaluate", "params": {
                        "expression": "({step: window.minipaged.head.step, drops: window.minipaged.view.drops, "
                                      "buffered: window.minipaged.view.events.length})", "returnByValue": True}})
                    while (message := await ws.receive_json(timeout=30)).get("id") != 1:
                        pass
                    value = message.get("result", {}).get("result", {}).get("value")
                    out.append(value if isinstance(value, dict) else {"step": None, "drops": None, "error": message})
        return out

    def __exit__(self, *exc: object) -> None:
        with suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--watchers", type=int, default=50)
    ap.add_argument("--pages", type=int, default=5, help="headless Chromium pages in the last phase (0: none)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    prompts = random_token_prompts(args.clients, 40, 120, seed=0, vocab=256)
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "serve.log")
        with open(log, "w") as out:
            server = subprocess.Popen(minipaged_serve_command(args.model, port, ["--threads", str(args.threads)]),
                                      stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for_answer(server, url + "/health", "minipaged serve", log)
            asyncio.run(phase(url, prompts[:2], 4, 0))                       # warm-up
            results = {}
            for name, watchers in (("none", 0), ("watchers", args.watchers), ("none_again", 0)):
                with RssSampler(server.pid) as rss:
                    results[name] = asyncio.run(phase(url, prompts, args.max_tokens, watchers))
                results[name]["peak_rss_mb"] = rss.peak
                print(name, results[name], flush=True)
            if args.pages:
                with Pages(url, args.pages) as pages, RssSampler(server.pid) as rss:
                    results["watchers_and_pages"] = asyncio.run(phase(url, prompts, args.max_tokens, args.watchers))
                    time.sleep(2)
                    states = asyncio.run(pages.states())
                last = results["watchers_and_pages"]["last_step"]
                results["watchers_and_pages"].update(peak_rss_mb=rss.peak, pages=states,
                                                     pages_complete=sum(s["step"] == last and not s["drops"]
                                                                        for s in states))
                print("pages", results["watchers_and_pages"], flush=True)
        finally:
            stop_process(server)
    base_tps = (results["none"]["tok_s"] + results["none_again"]["tok_s"]) / 2
    # The lower of the two no-watcher peaks: the first phase may still grow the allocator's pools.
    base_rss = min(results["none"]["peak_rss_mb"], results["none_again"]["peak_rss_mb"])
    w = results["watchers"]
    ratio, extra = w["tok_s"] / base_tps, w["peak_rss_mb"] - base_rss
    rows = [["no watchers", results["none"]["tok_s"], results["none"]["peak_rss_mb"], "-"],
            [f"{args.watchers} event-stream watchers", w["tok_s"], w["peak_rss_mb"],
             f"{w['watchers_complete']}/{args.watchers}"],
            ["no watchers (again)", results["none_again"]["tok_s"], results["none_again"]["peak_rss_mb"], "-"]]
    record = {"model": args.model, "clients": args.clients, "pages": args.pages, "max_tokens": args.max_tokens, "threads": args.threads,
              "phases": results, "throughput_ratio": ratio, "extra_rss_mb": extra,
              "baseline_tok_s": base_tps, "classroom_20_pages": CLASSROOM_20}
    if "watchers_and_pages" in results:
        p = results["watchers_and_pages"]
        rows.append([f"{args.watchers} watchers + {args.pages} Chromium pages (same cores)", p["tok_s"],
                     p["peak_rss_mb"], f"{p['watchers_complete']}/{args.watchers}, pages {p['pages_complete']}/"
                                       f"{args.pages}"])
        record["pages_throughput_ratio"] = p["tok_s"] / base_tps
    md = (f"### The live view's cost: {args.clients} streaming requests, {args.max_tokens} new tokens each, "
          f"{args.model}\n\n{machine_line()}\n\n"
          + table(["phase", "output tok/s", "server peak RSS MB", "watchers that got every step"], rows)
          + f"\n\n**{args.watchers} watchers: throughput {ratio:.2f}x** (target >= 0.95), **extra server RSS "
          f"{extra:.0f} MB** (target < 100 MB). The textual-serve classroom at 20 pages: "
          f"{CLASSROOM_20['ratio']:.2f}x, {CLASSROOM_20['rss_gb']} GB.")
    save("web_watchers", record, md)


if __name__ == "__main__":
    main()
