"""A headless Chromium for tests: open a page, screenshot it until it shows what a test waits for.

Why not ``chromium --screenshot --virtual-time-budget=N``: virtual time runs ahead of the real clock
while the page is idle, so the shot is taken before textual-serve's page has started its app process and
drawn the first frame (it shows the "minipaged classroom" intro card instead). So we drive the browser over
the DevTools protocol (CDP) with aiohttp's websocket client, already a dependency of textual-serve, and take
screenshots in real time until one passes the test's check or the deadline comes.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np

INSTALL_HINT = "apt-get install chromium-headless-shell (or chromium)"


def find_chromium() -> Optional[list[str]]:
    """The command that starts a headless Chromium here, or None: Debian's light headless shell first."""
    if shutil.which("chromium-headless-shell"):
        return ["chromium-headless-shell"]
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return [name, "--headless"]
    return None


def decode_png(data: bytes) -> np.ndarray:
    """RGB bytes (height x width x 3, uint8) of a PNG."""
    from matplotlib.image import imread

    image = imread(io.BytesIO(data), format="png")                   # floats in [0, 1], RGB or RGBA
    return (image[..., :3] * 255 + 0.5).astype(np.uint8)


def count_colour(rgb: np.ndarray, hex_colour: str, tolerance: int = 8) -> int:
    """How many pixels are within ``tolerance`` (per channel) of ``hex_colour``."""
    target = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
    return int((np.abs(rgb.astype(np.int16) - target).max(axis=-1) <= tolerance).sum())


class DevTools:
    """One CDP websocket session: ``call(method, **params)`` returns the result of that command."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.ids = itertools.count(1)

    async def call(self, method: str, **params) -> dict:
        call_id = next(self.ids)
        await self.ws.send_json({"id": call_id, "method": method, "params": params})
        while True:                                                    # skip events until our answer
            message = await self.ws.receive_json(timeout=30)
            if message.get("id") == call_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]


@contextlib.asynccontextmanager
async def open_page(url: str, size: tuple[int, int] = (1400, 900), timeout_s: float = 40.0,
                    offline: bool = False) -> AsyncIterator[DevTools]:
    """A fresh headless Chromium showing ``url``; yields the page's DevTools session. ``offline``: the page
    gets no network at all (DevTools' network emulation), as a file mailed to a class would open. The browser's
    whole process group is always killed and its profile removed."""
    import aiohttp

    command = find_chromium()
    assert command is not None, f"no Chromium here: {INSTALL_HINT}"
    profile = Path(tempfile.mkdtemp(prefix="minipaged-chromium-"))
    browser = subprocess.Popen([*command, "--no-sandbox", "--disable-gpu", "--no-first-run",
                                "--disable-background-networking", "--disable-component-update",
                                "--remote-debugging-port=0", f"--user-data-dir={profile}",
                                f"--window-size={size[0]},{size[1]}", "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)   # Debian's launcher is a shell script that does not
                                                         # exec: killing it alone leaves the browser running
    deadline = time.monotonic() + timeout_s
    try:
        port_file = profile / "DevToolsActivePort"          # Chromium writes its port here once it listens
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert browser.poll() is None, f"Chromium exited with {browser.returncode}"
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as answer:
                page = next(t for t in await answer.json() if t["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                tools = DevTools(ws)
                if offline:
                    await tools.call("Network.enable")
                    await tools.call("Network.emulateNetworkConditions", offline=True, latency=0,
                                     downloadThroughput=-1, uploadThroughput=-1)
                await tools.call("Page.navigate", url=url)
                yield tools
    finally:
        with suppress(ProcessLookupError):
            os.killpg(browser.pid, signal.SIGKILL)              # the launcher, the browser and its helpers
        browser.wait(10)
        shutil.rmtree(profile, ignore_errors=True)


async def evaluate(tools: DevTools, expression: str) -> Any:
    """The value of a JavaScript expression in the page (awaited if it is a promise), as JSON."""
    result = await tools.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
    if "exceptionDetails" in result:
        raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
    return result["result"].get("value")


async def wait_for(page: DevTools, expression: str, what: str, timeout_s: float = 40.0,
                   tolerate_errors: bool = False) -> Any:
    """The value of the page's JavaScript ``expression`` once it is truthy; fails saying ``what`` after
    ``timeout_s``. With ``tolerate_errors`` an expression that throws (an element not there yet while the page
    loads) counts as not yet true."""
    if tolerate_errors:
        expression = f"(() => {{ try {{ return {expression}; }} catch {{ return null; }} }})()"
    deadline = time.monotonic() + timeout_s
    while not (value := await evaluate(page, expression)):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.1)
    return value


async def screenshot(tools: DevTools) -> bytes:
    shot = await tools.call("Page.captureScreenshot", format="png")
    return base64.b64decode(shot["data"])


async def screenshot_when(url: str, ready: Callable[[bytes], bool], timeout_s: float = 40.0,
                          size: tuple[int, int] = (1400, 900), every_s: float = 1.0) -> tuple[bytes, bool]:
    """Open ``url`` in a fresh headless Chromium; screenshot it every ``every_s`` until ``ready(png)``.

    Returns the last PNG and whether it was ready.
    """
    deadline = time.monotonic() + timeout_s
    async with open_page(url, size, timeout_s) as tools:
        while True:
            await asyncio.sleep(every_s)
            png = await screenshot(tools)
            if ready(png):
                return png, True
            if time.monotonic() > deadline:
                return png, False


TRACE_CATEGORIES = "toplevel,devtools.timeline,disabled-by-default-devtools.timeline"


async def start_tracing(tools: DevTools) -> None:
    """Record the browser's tasks (DevTools' performance trace) until ``main_thread_tasks``."""
    await tools.call("Tracing.start", categories=TRACE_CATEGORIES, transferMode="ReturnAsStream")


async def main_thread_tasks(tools: DevTools) -> list[tuple[float, float]]:
    """End the trace; (wall ms, thread CPU ms) of each task on the pages' main threads (CrRendererMain).

    The CPU time is the one to judge a page's responsiveness by on a shared machine: on a busy test machine a
    task of 20 ms of work can take 200 ms of wall time while other processes run."""
    import json

    call_id = next(tools.ids)
    await tools.ws.send_json({"id": call_id, "method": "Tracing.end", "params": {}})
    while True:
        message = await tools.ws.receive_json(timeout=60)
        if message.get("method") == "Tracing.tracingComplete":
            handle = message["params"]["stream"]
            break
    chunks = []
    while True:
        piece = await tools.call("IO.read", handle=handle, size=1 << 20)
        chunks.append(base64.b64decode(piece["data"]).decode() if piece.get("base64Encoded") else piece["data"])
        if piece.get("eof"):
            break
    await tools.call("IO.close", handle=handle)
    trace = json.loads("".join(chunks))
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    main = {(e["pid"], e["tid"]) for e in events
            if e.get("ph") == "M" and e.get("name") == "thread_name" and e["args"].get("name") == "CrRendererMain"}
    return [(e["dur"] / 1000, e.get("tdur", e["dur"]) / 1000) for e in events
            if e.get("ph") == "X" and (e["pid"], e["tid"]) in main and e.get("name", "").endswith("RunTask")
            and "dur" in e]


def longest_task_share(tasks: list[tuple[float, float]]) -> float:
    """The longest main-thread task's share of all the main thread's CPU time in the trace (0 to 1).

    A page that stays responsive splits its work into many short tasks; one that parses or draws everything at
    once holds the thread in one. Both sides are CPU time of the same thread in the same run, so a loaded
    machine that slows every task alike leaves the share as it is (an absolute bound in ms did not: a class
    trial's loaded machine failed it). Absolute times belong in bench/."""
    cpu = [c for _wall, c in tasks]
    return max(cpu) / sum(cpu) if cpu and sum(cpu) > 0 else 0.0
