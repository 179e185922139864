"""Does anything a client does to the API server pause the engine core? (issue 47's target: a slow or paused
reader, a 7 MB request body or a burst of 500 connections never pauses the core's steps; the API server may slow.)

A victim streams a long answer while an adversary does one thing at a time. Two numbers per case:

- the core's longest gap between two steps, from the steps' own times (``StepEvent.time_s`` is stamped in the core
  process, so a late delivery by the API server does not change it), against the same with no adversary;
- the victim's longest pause between two streamed chunks, as its client sees it (the API server's share).

    python bench/core_isolation.py [--model smollm2 | --tiny]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from typing import Any, Callable

import httpx

from minipaged.bench.report import save
from minipaged.bench.servers import free_port, minipaged_serve_command, running

VICTIM_TOKENS = 1500


class Victim:
    """One stream decoding throughout; notes when each chunk arrives."""

    def __init__(self, url: str) -> None:
        self.url, self.arrivals, self.done = url, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"prompt": "a long story", "max_tokens": VICTIM_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.arrivals.append(time.monotonic())
        self.done.set()

    def longest_pause(self, since: float, until: float) -> float:
        times = [t for t in self.arrivals if since <= t <= until]
        return max((b - a for a, b in zip(times, times[1:])), default=float("nan"))


class StepTimes:
    """The core's step times, read from /v1/events."""

    def __init__(self, url: str) -> None:
        self.url, self.steps = url, []        # (arrival here, the core's time_s)
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with httpx.stream("GET", self.url + "/v1/events", timeout=None) as response:
            for line in response.iter_lines():
                if line.startswith('data: {"type":"step"'):
                    self.steps.append((time.monotonic(), json.loads(line[6:])["time_s"]))

    def longest_gap(self, since: float, until: float) -> float:
        """The core's longest gap between consecutive steps (by the core's own clock) from the last step
        delivered before ``since`` to the first delivered after ``until``: a slowed API server delivers late, but
        the steps' own times say when the core ran them."""
        before = [core for seen, core in self.steps if seen <= since]
        after = [core for seen, core in self.steps if seen >= until]
        low, high = (before[-1] if before else float("-inf")), (after[0] if after else float("inf"))
        core = [c for _seen, c in self.steps if low <= c <= high]
        return max((b - a for a, b in zip(core, core[1:])), default=float("nan"))


def big_body(url: str) -> None:
    """A 7 MB JSON body (a prompt of 1.5 million token ids): parsed and refused by the API server."""
    prompt = ",".join(["12345"] * 1_200_000)
    body = f'{{"prompt": [{prompt}], "max_tokens": 4}}'.encode()
    httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=120)


def connection_burst(url: str, count: int = 500) -> None:
    """500 connections opened at once, each sending a request's first line only, then closed."""
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\n")
            sockets.append(s)
        except OSError:
            break
    time.sleep(2.0)
    for s in sockets:
        s.close()


def paused_reader(url: str) -> None:
    """A stream of 16 samples with log-probabilities whose reader reads nothing for 5 s."""
    body = {"prompt": "pause", "max_tokens": 400, "n": 16, "logprobs": 5, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        time.sleep(5.0)
        for _ in response.iter_bytes():
            pass


CASES: dict[str, Callable[[str], None]] = {"none (3 s)": lambda _url: time.sleep(3.0), "7 MB body": big_body,
                                           "500 connections": connection_burst, "paused reader": paused_reader}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        from minipaged.model.testing import build_tiny_llama
        args.model = str(build_tiny_llama(tempfile.mkdtemp(prefix="isolation-"), tie_word_embeddings=True))
    port = free_port()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, \
            running(minipaged_serve_command(args.model, port, ["--threads", "1"]), port, what="minipaged serve",
                    log_path=os.path.join(tmp, "serve.log")) as url:
        steps = StepTimes(url)
        for name, case in CASES.items():
            victim = Victim(url)
            victim.thread.start()
            while len(victim.arrivals) < 20:
                time.sleep(0.01)
            start = time.monotonic()
            case(url)
            end = time.monotonic()
            time.sleep(1.0)
            rows.append({"case": name, "seconds": end - start, "core_longest_gap_s": steps.longest_gap(start, end),
                         "victim_longest_pause_s": victim.longest_pause(start, end + 1.0)})
            print(rows[-1], flush=True)
            victim.done.wait(300)
    md = ("| what a client did | for (s) | the core's longest gap between steps (s) | the victim's longest pause "
          "(s) |\n|---|---|---|---|\n" + "\n".join(
              f"| {r['case']} | {r['seconds']:.1f} | {r['core_longest_gap_s']:.3f} | {r['victim_longest_pause_s']:.3f} |"
              for r in rows))
    print(md)
    save("core_isolation_tiny" if args.tiny else "core_isolation",
         {"rows": rows, "model": "tiny random Llama" if args.tiny else args.model}, md)


if __name__ == "__main__":
    main()
