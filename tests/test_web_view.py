"""The browser live view (issue 25): a headless Chromium draws a live `minipaged serve` on the tiny model, a
prompt typed in the page becomes the student's own request, an exported trace opens with the network off,
`watch --replay --web` serves the same page, and a watcher that stops reading is dropped while the engine
and the other watchers carry on.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from browser_util import INSTALL_HINT, count_colour, decode_png, evaluate, find_chromium, open_page, screenshot
from serve_util import free_port, running_server, stop_process, wait_for_answer, wait_until_idle

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("web") / "server.log"
    # (a budget of 64 tokens: a decode's share of the batch bar is 1/64 of its width, a dozen pixels to find its
    # colour in; at the default 2,048 it is a sliver under a pixel wide, drawn or not by sub-pixel rounding)
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "160", "--max-num-batched-tokens", "64",
                        log_path=str(log)) as url:
        yield url


def region(rgb, rect: dict) -> "object":
    """The pixels of a screenshot inside an element's bounding box (device pixel ratio 1)."""
    x, y = int(rect["x"]), int(rect["y"])
    return rgb[y:y + int(rect["height"]), x:x + int(rect["width"])]


RECT = "(() => {{ const r = document.getElementById('{}').getBoundingClientRect(); " \
       "return {{x: r.x, y: r.y, width: r.width, height: r.height}}; }})()"


def stream_completions_until(url: str, prompt: str, max_tokens: int, current_id: list[str], enough: threading.Event,
                             most: int = 20) -> None:
    """Streaming requests one after another (at most ``most``) until ``enough`` is set; ``current_id`` holds the
    id of the one running. (One request alone may finish between two looks of a test: a tiny-model step takes
    well under a millisecond, so 400 tokens take a fraction of a second.)"""
    for _ in range(most):
        if enough.is_set():
            return
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            first = True
            for line in response.iter_lines():
                if first and line.startswith("data: {"):
                    current_id[:] = [json.loads(line[6:])["id"]]
                    first = False


@needs_chromium
def test_a_live_page_draws_a_request_in_its_colour_and_agrees_with_health(server, tmp_path):
    async def run() -> tuple[bytes, dict]:
        async with open_page(server + "/") as page:
            deadline = time.monotonic() + 40
            while not await evaluate(page, "window.minipaged && window.minipaged.view.connected"):
                assert time.monotonic() < deadline, "the page never connected to /v1/events"
                await asyncio.sleep(0.2)
            got_id: list[str] = []
            enough = threading.Event()
            sender = threading.Thread(target=stream_completions_until,
                                      args=(server, "blocks fill up " * 6, 400, got_id, enough, 100))
            sender.start()
            seen: dict = {"checks": 0}
            png = b""
            try:
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    if not got_id:
                        continue
                    rid = got_id[0]
                    # The page's fold and the engine's own count, at the step the page shows.
                    state = await evaluate(page, f"""(() => {{ const m = window.minipaged, s = m.state, ev = s.lastEvent;
                        return {{used: m.usedBlocks(), engine_used: ev.num_total_blocks - ev.num_free_blocks,
                                 holds: s.requests.has('{rid}') ? s.requests.get('{rid}').blocks.length : 0,
                                 scheduled: (ev.scheduled || []).some((x) => x.request_id === '{rid}'),
                                 colour: m.colour('{rid}'), step: s.step}}; }})()""")
                    assert state["used"] == state["engine_used"], state
                    seen["checks"] += 1
                    if state["holds"] < 4 or not state["scheduled"]:
                        continue       # (the id may be the last request's, finished: its blocks stay cached)
                    png = await screenshot(page)
                    rgb = decode_png(png)
                    in_map = count_colour(region(rgb, await evaluate(page, RECT.format("map"))), state["colour"])
                    in_bar = count_colour(region(rgb, await evaluate(page, RECT.format("batch-bar"))), state["colour"])
                    seen.update(state, in_map=in_map, in_bar=in_bar)
                    if in_map >= 4 * 300 and in_bar >= 50:      # four 22-pixel cells at least, and its batch share
                        break
            finally:
                enough.set()
                sender.join(120)
            health = wait_until_idle(server)
            while (await evaluate(page, "window.minipaged.head.step")) < health["steps"]:
                assert time.monotonic() < deadline + 20, "the page fell behind the engine"
                await asyncio.sleep(0.1)
            seen["idle_used"] = await evaluate(page, "window.minipaged.usedBlocks()")
            seen["health"] = health
            return png, seen

    png, seen = asyncio.run(run())
    (tmp_path / "live.png").write_bytes(png)
    assert seen.get("in_map", 0) >= 1200 and seen.get("in_bar", 0) >= 50, (seen, f"screenshot {tmp_path}/live.png")
    assert seen["checks"] >= 1
    health = seen["health"]
    assert seen["idle_used"] == health["blocks_total"] - health["blocks_free"]


@needs_chromium
def test_a_prompt_typed_in_the_page_is_completed_and_marked_mine(server):
    async def run() -> dict:
        async with open_page(server + "/") as page:
            deadline = time.monotonic() + 40
            while not await evaluate(page, "window.minipaged && window.minipaged.view.connected"):
                assert time.monotonic() < deadline, "the page never connected"
                await asyncio.sleep(0.2)
            await evaluate(page, "document.getElementById('prompt').focus()")
            await page.call("Input.insertText", text="hello from a student")
            for kind in ("keyDown", "keyUp"):
                await page.call("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                                windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)
            while True:
                found = await evaluate(page, """(() => { const m = window.minipaged, mine = [...m.view.mine];
                    const r = mine.length && m.head.requests.get(mine[0]);
                    const row = mine.length && document.querySelector(`tr[data-request="${mine[0]}"]`);
                    return {mine, state: r ? r.state : null, finish: r ? r.finish_reason : null,
                            prompt: r ? r.prompt : null, row_mine: row ? row.dataset.mine : null,
                            box: document.getElementById('prompt').value}; })()""")
                if found["state"] == "finished" and found["row_mine"]:
                    return found
                assert time.monotonic() < deadline, found
                await asyncio.sleep(0.2)

    found = asyncio.run(run())
    assert len(found["mine"]) == 1 and found["mine"][0].startswith("chatcmpl-")
    assert found["finish"] in ("stop", "length") and "hello from a student" in found["prompt"]
    assert found["row_mine"] == "true" and found["box"] == ""


def record_trace(tiny_engine_factory, path: Path) -> tuple[int, int]:
    """A run with prefix hits and preemption, recorded until mid-run (blocks still in use at its last step).
    Returns (the number of steps, the used blocks at the last one)."""
    from minipaged import SamplingParams
    from minipaged.trace import write_trace_event, write_trace_header

    engine = tiny_engine_factory(num_blocks=24, preemption_mode="swap", num_cpu_blocks=32,
                                 max_num_batched_tokens=16)
    system = list(range(10, 34))
    for i in range(6):
        engine.add_request(system + [40 + i] * (3 + i), SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
    events = [engine.step().event for _ in range(18)]
    with open(path, "w") as fp:
        write_trace_header(fp, engine.info)
        for ev in events:
            write_trace_event(fp, ev)
    last = events[-1]
    return len(events), last.num_total_blocks - last.num_free_blocks


@needs_chromium
def test_an_exported_trace_opens_offline_and_its_slider_reaches_the_last_step(tiny_engine_factory, tmp_path):
    trace, page_file = tmp_path / "run.jsonl", tmp_path / "run.html"
    num_steps, last_used = record_trace(tiny_engine_factory, trace)
    assert last_used > 0
    # The command, in a fresh interpreter: it must not need torch (a teacher mails the file; anyone opens it).
    check = ("import sys; from minipaged.cli import main; code = main(['export-html', sys.argv[1], '-o', sys.argv[2]]);"
             " assert 'torch' not in sys.modules, 'export-html imported torch'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", check, str(trace), str(page_file)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    html = page_file.read_text()
    for outside in ('src="', 'href="', "url(", "fetch("):       # nothing loaded from anywhere, but the trace
        assert outside not in html.split('id="trace"')[0], outside
    assert 'src="' not in html and 'rel="stylesheet"' not in html

    async def run() -> dict:
        async with open_page(page_file.as_uri() + "?projector=1", offline=True) as page:
            deadline = time.monotonic() + 30
            while not await evaluate(page, "!!(window.minipaged && window.minipaged.state)"):
                assert time.monotonic() < deadline, "the exported page never drew"
                await asyncio.sleep(0.2)
            first = await evaluate(page, "window.minipaged.state.step")
            await evaluate(page, """(() => { const s = document.getElementById('slider');
                s.value = s.max; s.dispatchEvent(new Event('input')); })()""")
            await asyncio.sleep(0.3)
            seen = {"first": first, "max": await evaluate(page, "Number(document.getElementById('slider').max)"),
                    "step": await evaluate(page, "window.minipaged.state.step"),
                    "used": await evaluate(page, "window.minipaged.usedBlocks()"),
                    "label": await evaluate(page, "document.getElementById('step-label').textContent"),
                    "projector": await evaluate(page, "document.body.classList.contains('projector')"),
                    "cell": await evaluate(page, "getComputedStyle(document.querySelector('#map .cell')).width"),
                    "log_shown": await evaluate(page, "getComputedStyle(document.getElementById('log-panel')).display")}
            await evaluate(page, "document.getElementById('back').click()")       # the viewer steps back
            await asyncio.sleep(0.3)
            seen["after_back"] = await evaluate(page, "window.minipaged.state.step")
            return seen

    seen = asyncio.run(run())
    assert seen["first"] == 1 and seen["max"] == num_steps - 1, seen
    assert seen["step"] == num_steps and seen["used"] == last_used, (seen, last_used)
    assert f"step {num_steps}" in seen["label"] and seen["after_back"] == num_steps - 1
    # ?projector=1: cells fitted to the screen (test_web_projector.py), at least twice the desk's 22 px
    assert seen["projector"] and float(seen["cell"].rstrip("px")) >= 44 and seen["log_shown"] == "none", seen


def test_watch_replay_web_serves_the_page_without_torch(tmp_path):
    trace = Path(__file__).parent / "data" / "watch_trace.jsonl"
    port = free_port()
    log = tmp_path / "replay.log"
    check = ("import sys, runpy; sys.argv = ['minipaged'] + sys.argv[1:];"
             "import minipaged.web.replay as r; serve = r.serve_replay\n"
             "def guarded(*a):\n    assert 'torch' not in sys.modules, 'watch --web imported torch'\n    return serve(*a)\n"
             "r.serve_replay = guarded\nfrom minipaged.cli import main; sys.exit(main())")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", check, "watch", "--replay", str(trace), "--web",
                                 "--web-port", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_answer(proc, f"http://127.0.0.1:{port}/", "watch --replay --web", str(log), timeout_s=30)
        page = httpx.get(f"http://127.0.0.1:{port}/").text
        assert 'id="trace"' in page and '"type":"engine"' in page.replace(" ", "") and "applyEvent" in page
        assert httpx.get(f"http://127.0.0.1:{port}/etc/passwd").status_code == 404
        # Ctrl-C stops it, also while a browser holds a connection open and sends nothing (a preconnect does)
        idle = socket.create_connection(("127.0.0.1", port))
        try:
            time.sleep(0.3)                                # (its thread is waiting for a request line)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) == 0
        finally:
            idle.close()
    finally:
        stop_process(proc)


def test_watch_replay_web_stops_on_ctrl_c_even_started_with_sigint_ignored(tmp_path):
    """A process started with SIGINT ignored (it is inherited: a test runner's worker, a launcher) never sees
    Python's KeyboardInterrupt; the replay page's server waits for the signal through a handler of its own."""
    trace = Path(__file__).parent / "data" / "watch_trace.jsonl"
    port = free_port()
    log = tmp_path / "replay.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minipaged", "watch", "--replay", str(trace), "--web",
                                 "--web-port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        wait_for_answer(proc, f"http://127.0.0.1:{port}/", "watch --replay --web", str(log), timeout_s=30)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
        proc = subprocess.Popen([sys.executable, "-m", "minipaged", "watch", "--replay", str(trace), "--web",
                                 "--web-port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_answer(proc, f"http://127.0.0.1:{port}/", "watch --replay --web", str(log), timeout_s=30)
        proc.send_signal(signal.SIGTERM)                   # a SIGTERM ends it as cleanly
        assert proc.wait(timeout=20) == 0
    finally:
        stop_process(proc)


def server_pid(port: int) -> int:
    """The pid of the `minipaged serve` listening on ``port`` (found by its command line)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"serve" in cmd and str(port).encode() in cmd:
                return int(entry)
    raise AssertionError(f"no server process for port {port}")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def workload(url: str, max_tokens: int) -> float:
    """Ten requests at once, one sequence at a time on this server; returns the seconds they took."""
    started = time.monotonic()
    with httpx.Client(timeout=120) as client:
        threads = [threading.Thread(target=lambda i=i: client.post(url + "/v1/completions", json={
            "prompt": f"student {i} asks about paged attention " * 4, "max_tokens": max_tokens, "ignore_eos": True}))
            for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    return time.monotonic() - started


def test_a_watcher_that_stops_reading_is_dropped_and_nobody_else_waits(tiny_model, tmp_path):
    log = tmp_path / "server.log"
    # One sequence at a time: a step per token, 3,000 steps, ~4 MB of events: more than the kernel's socket
    # buffers hold (~2 MB here), so the stalled watcher's backlog reaches the server's own buffer (0.5 MB, counted
    # uncompressed: the reading gzip watcher gets that much slack too).
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "160", "--event-buffer-mb", "0.5",
                        "--max-num-seqs", "1", log_path=str(log)) as url:
        port = int(url.rsplit(":", 1)[1])
        pid = server_pid(port)
        httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 8}, timeout=60)
        alone = workload(url, 60)                 # the engine's pace with nobody watching (a fifth of the work)
        # The stalled watcher: a socket with a tiny receive window that never reads.
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", port))
        stalled.sendall(b"GET /v1/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        # A reading watcher, gzipped: it must see every step, in order.
        steps: list[int] = []
        reading = threading.Event()

        def read_all() -> None:
            with httpx.stream("GET", url + "/v1/events", headers={"Accept-Encoding": "gzip"}, timeout=60) as r:
                assert r.headers["content-encoding"] == "gzip"
                reading.set()
                try:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            record = json.loads(line[6:])
                            if record.get("type") == "step":           # (the goodbye has none)
                                steps.append(record["step"])
                except httpx.HTTPError:
                    pass                                     # the server stopped at the end of the test
        reader = threading.Thread(target=read_all, daemon=True)
        reader.start()
        assert reading.wait(20)
        rss_before = rss_mb(pid)
        took = workload(url, 300)
        health = wait_until_idle(url)
        rss_after = rss_mb(pid)
        # Everything the stalled socket will ever get: the start of the stream, "dropped", then the end.
        stalled.settimeout(5)
        received = b""
        try:
            while (chunk := stalled.recv(65536)) and b"event: dropped" not in received:
                received += chunk
        except socket.timeout:
            pass
        stalled.close()
        deadline = time.monotonic() + 10
        while (not steps or steps[-1] < health["steps"]) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert b"event: dropped" in received and b"reason" in received, received[-500:]
    assert steps == list(range(steps[0], health["steps"] + 1)), "the reading watcher missed steps"
    assert health["steps"] >= 3000
    assert rss_after - rss_before < 30, (rss_before, rss_after)
    assert took < 5 * alone * 2, (took, alone)     # five times the work: not slower per token than twice alone
    assert "dropped an event-stream watcher" in log.read_text()


def test_web_view_md_is_its_template_filled_from_the_benchmark_json():
    from minipaged.bench.docs import WEB_VIEW_DOC, WEB_VIEW_TEMPLATE, bench_results, rendered_web_view_doc
    from minipaged.placeholders import hand_written_numbers

    assert WEB_VIEW_DOC.read_text(encoding="utf-8") == rendered_web_view_doc(bench_results()), (
        "docs/web-view.md is not docs/web-view.md.in filled from bench/out/web_watchers.json: run "
        "python bench/render_docs.py")
    typed = hand_written_numbers(WEB_VIEW_TEMPLATE.read_text(encoding="utf-8"), [r"target: [^)]*\)"])
    assert not typed, f"numbers typed by hand in docs/web-view.md.in: {typed}"


@needs_chromium
def test_with_an_api_key_the_page_asks_once_and_a_frozen_view_keeps_buffering(tiny_model, tmp_path):
    log = tmp_path / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--api-key", "class-secret",
                        log_path=str(log)) as url:
        async def run() -> dict:
            async with open_page(url + "/") as page:
                deadline = time.monotonic() + 40
                while await evaluate(page, "(document.getElementById('key-form') || {hidden: true}).hidden") is not False:
                    assert time.monotonic() < deadline, "the page never asked for the key"
                    await asyncio.sleep(0.2)
                await evaluate(page, """(() => { document.getElementById('key').value = 'class-secret';
                    document.getElementById('key-form').requestSubmit(); })()""")
                # Connected (the stream's headers came) and drawn (its snapshot came: the page has a state to
                # freeze); the two are a moment apart, and freezing in between left no step to compare with.
                while not await evaluate(page, "window.minipaged.view.connected && window.minipaged.state !== null"):
                    assert time.monotonic() < deadline, "the page did not connect with the key"
                    await asyncio.sleep(0.2)
                await evaluate(page, "window.minipaged.freeze(true)")
                frozen_at = await evaluate(page, "window.minipaged.state.step")
                answer = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer class-secret"},
                                    json={"prompt": "while the view is frozen", "max_tokens": 12}, timeout=60)
                assert answer.status_code == 200, answer.text
                steps = httpx.get(url + "/health").json()["steps"]
                while await evaluate(page, "window.minipaged.head.step") < steps:
                    assert time.monotonic() < deadline, "the frozen page stopped buffering events"
                    await asyncio.sleep(0.1)
                seen = {"frozen_at": frozen_at, "shown": await evaluate(page, "window.minipaged.state.step"),
                        "status": await evaluate(page, "document.getElementById('status').textContent"),
                        "stored": await evaluate(page, "localStorage.getItem('minipaged-api-key')")}
                await evaluate(page, "window.minipaged.live()")
                await asyncio.sleep(0.3)
                seen["live"] = await evaluate(page, "window.minipaged.state.step")
                seen["steps"] = steps
                return seen

        seen = asyncio.run(run())
    assert seen["stored"] == "class-secret"
    assert seen["shown"] == seen["frozen_at"] and "frozen" in seen["status"]      # the view did not move ...
    assert seen["live"] == seen["steps"] > seen["frozen_at"]                       # ... but the events came


def test_bad_replay_and_export_requests_say_what_to_do(tmp_path, capsys):
    from minipaged.cli import main

    assert main(["watch", "--web"]) == 2
    assert "--web serves one recorded run: give it with --replay FILE" in capsys.readouterr().err
    not_a_trace = tmp_path / "notes.txt"
    not_a_trace.write_text("hello\n")
    assert main(["export-html", str(not_a_trace)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {not_a_trace}" in err and "not a minipaged trace line" in err
    assert not (tmp_path / "notes.html").exists()
