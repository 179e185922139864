"""Issue 39: the event stream and the pages stay small and safe whatever one request sends.

An arrival carries a bounded preview of its prompt, once for all its samples; the whole text is fetched on
demand behind the API key; a watcher's backlog counts uncompressed bytes; the pages written for replay keep
their script whatever a prompt contains.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from minipaged import SamplingParams
from minipaged.event_view import EngineView
from minipaged.events import PREVIEW_GAP, PROMPT_PREVIEW_CHARS, StepEvent
from browser_util import (INSTALL_HINT, evaluate, find_chromium, longest_task_share, main_thread_tasks, open_page,
                          start_tracing, wait_for)
from serve_util import free_port, running_server, wait_until_idle

needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")


def test_an_arrival_carries_a_bounded_preview_once_for_all_its_samples(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=1024)
    prompt = "start of a long prompt " + "=" * 1800 + "and its own end"    # near the tiny model's context
    engine.add_request(prompt, SamplingParams(n=8, max_tokens=1, temperature=1.0), request_id="big")
    event = engine.step().event
    line = event.to_json()
    arrivals = json.dumps(json.loads(line)["arrivals"])
    assert len(arrivals) < 3000, len(arrivals)               # not the 1.8 KB prompt eight times over (15 KB)
    first, *others = event.arrivals
    assert len(first.prompt) <= PROMPT_PREVIEW_CHARS and PREVIEW_GAP in first.prompt
    assert first.prompt.startswith("start of a long prompt") and first.prompt.endswith("and its own end")
    assert all(a.prompt == "" and a.prompt_of == "big.0" for a in others)
    view = EngineView(engine.info)                           # a watcher still sees each sample's prompt
    view.apply(StepEvent.from_dict(json.loads(line)))
    assert {r.prompt for r in view.requests.values()} == {first.prompt} and len(view.requests) == 8


def test_traces_recorded_before_previews_replay(tiny_engine_factory):
    """Old arrivals: a whole prompt (no prompt_of), or the older prompt_preview key."""
    old = {"type": "step", "step": 1, "time_s": 0.1, "duration_s": 0.1, "schedule_s": 0.0, "model_s": 0.1,
           "budget_limit": 32, "budget_used": 0, "max_num_seqs": 8,
           "arrivals": [{"request_id": "a", "prompt_len": 3, "max_tokens": 4, "prompt": "x" * 5000},
                        {"request_id": "b", "prompt_len": 3, "max_tokens": 4, "prompt_preview": "older"}]}
    event = StepEvent.from_dict(old)
    assert [a.prompt_of for a in event.arrivals] == [None, None]
    view = EngineView(tiny_engine_factory().info)
    view.apply(event)
    assert view.requests["a"].prompt == "x" * 5000 and view.requests["b"].prompt == "older"


# ------------------------------------------------------------------------------ a live server, HTTP only

KEY = "class-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("web-safety") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "2048", "--api-key", KEY,
                        "--max-client-samples", "130", "--max-client-prompt-tokens", "150000",
                        "--allowed-hosts", "class.example", "--max-waiting-requests", "1000",
                        log_path=str(log)) as url:
        yield url


def as_client(address: str) -> httpx.Client:
    """An HTTP client whose connections come from ``address`` (127.0.0.x: loopback on Linux; only 127.0.0.1 keeps
    to no share), which lets one test speak as several clients on real connections: no forwarded header is
    believed."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), headers=AUTH, timeout=60)


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_only_the_servers_own_host_names_are_answered(server):
    port = server.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"class.example:{port}", f"[::1]:{port}"):
        assert httpx.get(server + "/health", headers={"Host": host}).status_code == 200, host
    refused = httpx.get(server + "/v1/events", headers={**AUTH, "Host": f"evil.example:{port}"})
    error = openai_error(refused, 400)
    assert "'evil.example'" in error["message"] and "--allowed-hosts evil.example" in error["message"]


def test_which_names_a_bind_address_answers_to():
    from minipaged.serve.host_check import allowed_hosts, host_name, machine_names

    assert host_name("Example.COM:8000") == "example.com" and host_name("[::1]:80") == "::1"
    assert host_name("::1") == "::1" and host_name("10.0.0.5") == "10.0.0.5"
    local = allowed_hosts("127.0.0.1")                   # loopback-bound: loopback names only
    assert "localhost" in local and not (machine_names() - {"127.0.0.1", "::1", "localhost"}) & local
    room = allowed_hosts("0.0.0.0", ["Class.Example"])
    assert {"localhost", "class.example", socket.gethostname().lower()} <= room
    assert "10.1.2.3" in allowed_hosts("10.1.2.3")
    assert "*" in allowed_hosts("127.0.0.1", ["*"])


def test_the_page_and_its_files_may_not_be_framed_or_load_anything_foreign(server):
    for path in ("/", "/web/app.mjs", "/web/style.css"):
        headers = httpx.get(server + path).headers
        csp = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'self'" in csp, path
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff", path


def test_a_body_that_is_not_json_is_told_to_send_json(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        refused = httpx.post(server + "/v1/completions", content=body, headers={**AUTH, "Content-Type": media})
        assert "send application/json" in openai_error(refused, 400)["message"], media
    ok = httpx.post(server + "/v1/completions", content=body, timeout=60,
                    headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_the_whole_prompt_is_there_on_demand_behind_the_key(server):
    prompt = "the start " + "=" * 1500 + " the end"
    body = {"prompt": prompt, "n": 2, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        request_id = next(json.loads(line[6:])["id"] for line in lines if line.startswith("data: {"))
        whole = httpx.get(f"{server}/v1/events/prompts/{request_id}.1", headers=AUTH, timeout=10)
        assert httpx.get(f"{server}/v1/events/prompts/{request_id}", timeout=10).status_code == 401
    assert whole.status_code == 200 and whole.json()["prompt"] == prompt
    finished = httpx.get(f"{server}/v1/events/prompts/{request_id}", headers=AUTH, timeout=10)
    assert finished.json()["prompt"] == prompt                      # the page still shows it: still there
    unknown = httpx.get(f"{server}/v1/events/prompts/{request_id}x", headers=AUTH, timeout=10)
    assert "finished lately" in openai_error(unknown, 404)["message"]
    wait_until_idle(server)


def test_client_shares_count_samples_and_tokens_and_come_back_however_a_request_ends():
    from minipaged.serve.fair_share import ClientQuotas
    from minipaged.serve.protocol import ServerError

    quotas = ClientQuotas(max_samples=10, max_prompt_tokens=1000)
    assert quotas.take_samples("127.0.0.1", 500) is None and quotas.take_samples("::1", 500) is None   # local
    first = quotas.take_samples("10.0.0.1", 6)
    quotas.take_tokens(first, 100)                                      # 600 tokens
    with pytest.raises(ServerError) as refused:
        quotas.take_samples("10.0.0.1", 5)
    assert refused.value.status == 429 and "--max-client-samples" in str(refused.value.body())
    second = quotas.take_samples("10.0.0.1", 4)
    with pytest.raises(ServerError) as refused:
        quotas.take_tokens(second, 101)                                 # 600 + 404 > 1000
    assert refused.value.status == 429 and "--max-client-prompt-tokens" in str(refused.value.body())
    with pytest.raises(ServerError) as never:
        quotas.take_samples("10.0.0.2", 11)
    assert never.value.status == 400
    quotas.release(second)
    quotas.take_tokens(second, 1)               # the client left before its prompt was counted: nothing held
    quotas.release(first)
    quotas.release(first)                       # twice is once
    assert quotas.samples == {} and quotas.tokens == {}                 # an idle client costs nothing


def test_one_client_over_its_share_gets_429_and_the_others_are_served(server):
    held = {"prompt": [7] * 1000, "n": 100, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with as_client("127.0.0.2") as hog, as_client("127.0.0.3") as other, as_client("127.0.0.4") as third:
        with hog.stream("POST", server + "/v1/completions", json=held) as held_stream:
            lines = held_stream.iter_lines()          # kept: an iterator dropped half-way closes the response
            next(line for line in lines if line.startswith("data: {"))                  # in the engine
            more = {"prompt": "hi", "n": 40, "max_tokens": 2}
            refused = hog.post(server + "/v1/completions", json=more)
            error = openai_error(refused, 429)
            assert error["type"] == "RateLimitError" and "--max-client-samples" in error["message"]
            assert refused.headers["retry-after"] == "1"
            tokens = {"prompt": [8] * 1900, "n": 28, "max_tokens": 1}      # 100 x 1000 + 28 x 1900 > 150,000
            refused = hog.post(server + "/v1/completions", json=tokens)
            assert "--max-client-prompt-tokens" in openai_error(refused, 429)["message"]
            served = other.post(server + "/v1/completions", json=more)
            assert served.status_code == 200 and len(served.json()["choices"]) == 40
        never = {"prompt": [9] * 1600, "n": 100, "max_tokens": 1}            # 160,000 tokens: never fits
        assert "--max-client-prompt-tokens 150000" in openai_error(
            third.post(server + "/v1/completions", json=never), 400)["message"]
        health = wait_until_idle(server, timeout=30)
        assert health["blocks_free"] == health["blocks_total"]
        again = hog.post(server + "/v1/completions", json=more)
        assert again.status_code == 200                                  # the hog's share came back when it left


# ------------------------------------------------------------------------------ fair sharing, measured

def test_a_long_n_sample_prompt_is_chunked_and_a_running_decode_keeps_its_pace(tiny_engine_factory):
    """Another client's 16-token request is decoding when a long prompt with n=10 samples arrives (the
    issue's 7,000-token case, scaled to the tiny model): chunked prefill spends only the budget left after
    the decodes, so the 16-token request gets a token in every step and finishes before the long one's first
    token; no step computes more than the budget (its time is bounded)."""
    budget = 64
    engine = tiny_engine_factory(num_blocks=2048, max_num_batched_tokens=budget, max_num_seqs=16)
    victim = engine.add_request([5] * 12, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    engine.step()                                            # the victim's prompt: it decodes from now on
    hog = engine.add_request([9] * 1800, SamplingParams(n=10, temperature=1.0, seed=0, max_tokens=4,
                                                        ignore_eos=True))
    victim_tokens, hog_first_token, steps = [], None, 0
    while engine.has_unfinished_requests():
        event = engine.step().event
        steps += 1
        assert event.budget_used <= budget
        victim_tokens.append(len(event.new_token_ids.get(victim, ())))
        if hog_first_token is None and any(rid.startswith(f"{hog}.") for rid in event.new_token_ids):
            hog_first_token = steps
        if any(f.request_id == victim for f in event.finished):
            victim_done = steps
    assert victim_tokens[:victim_done] == [1] * victim_done       # a token every step, 15 steps
    assert victim_done == 15 and hog_first_token > 1800 // budget > victim_done


# ------------------------------------------------------------------------------ pages written for replay

def record_with_prompt(tiny_engine_factory, path, prompt: str) -> None:
    from minipaged.trace import write_trace_event, write_trace_header

    engine = tiny_engine_factory()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), request_id="r0")
    with open(path, "w") as fp:
        write_trace_header(fp, engine.info)
        while engine.has_unfinished_requests():
            write_trace_event(fp, engine.step().event)


HOSTILE = 'look: <!--<script> and </script><script>alert(1)</script> <\\/script> </SCRIPT'


def test_an_exported_page_keeps_its_script_whatever_a_prompt_holds(tiny_engine_factory, tmp_path):
    from minipaged.web import trace_html

    trace = tmp_path / "run.jsonl"
    record_with_prompt(tiny_engine_factory, trace, HOSTILE)
    html = trace_html(str(trace))
    embedded = html.split('<script type="application/json" id="trace">', 1)[1].split("</script>", 1)[0]
    assert "<" not in embedded                                  # nothing in there can open or close a tag
    assert json.loads(embedded.strip().splitlines()[1])["arrivals"][0]["prompt"] == HOSTILE


@needs_chromium
def test_an_exported_page_with_a_hostile_prompt_draws_in_a_browser(tiny_engine_factory, tmp_path):
    from minipaged.web.replay import export_html

    trace, page_file = tmp_path / "run.jsonl", tmp_path / "run.html"
    record_with_prompt(tiny_engine_factory, trace, HOSTILE)
    assert export_html(str(trace), str(page_file)) == 0

    async def run() -> dict:
        async with open_page(page_file.as_uri(), offline=True) as page:
            deadline = time.monotonic() + 30
            while not await evaluate(page, "!!(window.minipaged && window.minipaged.state)"):
                assert time.monotonic() < deadline, "the exported page never drew (its script was swallowed?)"
                await asyncio.sleep(0.2)
            return {"prompt": await evaluate(page, "window.minipaged.head.requests.get('r0').prompt")}

    seen = asyncio.run(run())
    assert seen["prompt"] == HOSTILE


# ------------------------------------------------------------------------------ the attach TUI's header

TRACE = Path(__file__).parent / "data" / "watch_trace.jsonl"


def test_the_attach_header_says_the_server_is_gone_instead_of_live():
    """A server that streams a header and a step, then dies (no goodbye, the port closed): the attach TUI
    tries to reconnect once, and then its header says SERVER GONE, not LIVE."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from minipaged.tui.attach import AttachApp, AttachRun

    lines = TRACE.read_text().splitlines()[:3]
    release = threading.Event()

    class DyingServer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:          # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for line in lines:
                self.wfile.write(f"data: {json.dumps(json.loads(line))}\n\n".encode())
            self.wfile.flush()
            release.wait(20)                                    # the test has seen LIVE: now die

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), DyingServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"

    async def run() -> tuple[str, str]:
        app = AttachApp(AttachRun(url, silence_timeout_s=5))
        async with app.run_test(size=(160, 45)) as pilot:
            deadline = time.monotonic() + 20
            while app.state is None or app.state.num_events < 2:
                assert time.monotonic() < deadline, "the TUI never drew the stream"
                await pilot.pause(0.05)
            alive = app._topbar().plain
            httpd.shutdown()
            httpd.server_close()                                # reconnecting finds nobody
            release.set()
            while app.attach.lost is None:
                assert time.monotonic() < deadline + 10, "the TUI never noticed the server was gone"
                await pilot.pause(0.05)
            await pilot.pause(0.2)
            gone = app._topbar().plain
            await pilot.press("q")
        return alive, gone

    alive, gone = asyncio.run(run())
    assert " LIVE " in alive
    assert "SERVER GONE" in gone and " LIVE " not in gone


# ------------------------------------------------------------------------------ the page under load

CSP_WATCH = """(() => { window.__csp = [];
  document.addEventListener("securitypolicyviolation", (e) => window.__csp.push(e.violatedDirective));
  return true; })()"""


async def heap_mb(page) -> float:
    """The page's JavaScript heap in use after a full garbage collection, in MB (DevTools)."""
    await page.call("HeapProfiler.collectGarbage")
    return (await page.call("Runtime.getHeapUsage"))["usedSize"] / 2**20


LONG_PROMPT = "a long prompt starts here " + "-" * 1500 + " and ends here"


async def whole_prompt_from_the_page(page) -> str:
    """A request with a long prompt runs; the page's "whole prompt" button fetches it (the events had only a
    preview)."""
    body = {"prompt": LONG_PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", page.base_url + "/v1/completions", json=body, headers=AUTH, timeout=60) as answer:
        lines = answer.iter_lines()
        rid = next(json.loads(line[6:])["id"] for line in lines if line.startswith("data: {"))
        await wait_for(page, f"!!document.querySelector('tr[data-request=\"{rid}\"]')", "the request never showed")
        await evaluate(page, f"document.querySelector('tr[data-request=\"{rid}\"]').click()")
        await wait_for(page, "!document.getElementById('whole-prompt').hidden", "no 'whole prompt' button")
        await evaluate(page, "document.getElementById('whole-prompt').click()")
        await wait_for(page, "document.getElementById('whole-prompt-text').textContent.endsWith('ends here')",
                       "the whole prompt never came")
        return await evaluate(page, "document.getElementById('whole-prompt-text').textContent")



def test_the_pages_responsiveness_is_judged_by_a_share_that_a_loaded_machine_keeps():
    """The page tests' bound, without a browser: the same trace slowed tenfold by a loaded machine passes as it
    did (the old 200 ms bound failed it), and one task holding the thread (a 64 MB line parsed) fails."""
    quiet = [(2.0, 1.5)] * 300 + [(30.0, 25.0)]                    # (wall ms, CPU ms): many short tasks
    loaded = [(wall * 10, cpu * 10) for wall, cpu in quiet]
    assert max(cpu for _w, cpu in loaded) >= 200                 # what failed on the class trial's machine
    assert longest_task_share(loaded) == pytest.approx(longest_task_share(quiet))
    assert longest_task_share(loaded) < 0.1
    assert longest_task_share(quiet + [(600.0, 500.0)]) > 0.25   # one task holds the thread
    assert longest_task_share([]) == 0.0

@needs_chromium
def test_the_page_stays_responsive_and_its_heap_bounded_under_big_n_sample_requests(server):
    """The issue's case on the tiny model: 100 requests with n=128 samples of a 1,000-token prompt, one after
    another (the step that admits a request's samples has an event of ~0.5 MB: every sample's blocks). The page's
    main thread does its work in many short tasks, no one of them a tenth of the thread's CPU over the run
    (DevTools' trace; a share, not milliseconds: a loaded machine slows every task alike), the heap after request
    100 is what it was after request 10 (the page keeps ?buffer_mb=2 of steps and the 200 latest finished
    requests), no CSP violation, and the "forget key" control takes the key out of the browser."""
    requests_done, sent = [], threading.Event()

    def send(count: int) -> None:
        with httpx.Client(timeout=120) as client:
            for i in range(count):
                body = {"prompt": [10 + i % 200] + [7] * 999, "n": 128, "max_tokens": 1, "ignore_eos": True}
                answer = client.post(server + "/v1/completions", json=body, headers=AUTH)
                assert answer.status_code == 200, answer.text
                requests_done.append(i)
        sent.set()

    async def caught_up(page) -> None:
        steps = wait_until_idle(server, timeout=60)["steps"]
        await wait_for(page, f"window.minipaged.head.step >= {steps}", "the page fell behind the engine")

    async def run() -> dict:
        async with open_page(server + "/?buffer_mb=2") as page:
            await wait_for(page, "!(document.getElementById('key-form') || {hidden: true}).hidden", "no key asked")
            await evaluate(page, f"""(() => {{ document.getElementById('key').value = '{KEY}';
                document.getElementById('key-form').requestSubmit(); }})()""")
            await wait_for(page, "window.minipaged.view.connected && window.minipaged.state !== null", "no stream")
            await evaluate(page, CSP_WATCH)
            page.base_url = server
            await start_tracing(page)
            seen = {}
            for count, name in ((10, "heap_10"), (90, "heap_100")):  # requests; then the heap
                sender = threading.Thread(target=send, args=(count,))
                sender.start()
                while sender.is_alive():
                    await asyncio.sleep(0.2)
                assert len(requests_done) == count or name == "heap_100", requests_done
                await caught_up(page)
                await asyncio.sleep(0.3)                     # the last frame drawn
                seen[name] = await heap_mb(page)
            seen.update(await evaluate(page, """(() => ({csp: window.__csp,
                requests: window.minipaged.head.requests.size,
                events: window.minipaged.view.events.length, buffer_chars: window.minipaged.view.bufferChars,
                forget_shown: !document.getElementById('forget-key').hidden}))()"""))
            tasks = await main_thread_tasks(page)
            seen["tasks"] = len(tasks)
            seen["longest_cpu"] = max(cpu for _wall, cpu in tasks)
            seen["longest_share"] = longest_task_share(tasks)
            seen["whole_prompt"] = await whole_prompt_from_the_page(page)
            await evaluate(page, "document.getElementById('forget-key').click()")
            await wait_for(page, "!document.getElementById('key-form').hidden", "forgetting did not ask again")
            seen["stored"] = await evaluate(page, "localStorage.getItem('minipaged-api-key')")
            return seen

    seen = asyncio.run(run())
    print("page under load:", {k: v for k, v in seen.items() if k not in ("csp", "whole_prompt")})
    assert seen["tasks"] > 100 and seen["longest_share"] < 0.1, repr(seen)   # of the main thread's CPU
    assert seen["heap_100"] - seen["heap_10"] < 3, seen             # MB
    assert seen["requests"] <= 200 and seen["buffer_chars"] <= 2 * 2**20, seen   # ?buffer_mb=2
    assert seen["csp"] == [], seen
    assert seen["forget_shown"] and seen["stored"] is None, seen
    assert seen["whole_prompt"] == LONG_PROMPT


@needs_chromium
def test_the_page_survives_64_mb_event_lines_of_an_older_server():
    """What a server before this fix sent for {"prompt": "=" * 500000, "n": 128}: one 64 MB line (every sample's
    arrival with the whole prompt). A stand-in server sends three of them between the steps of a recorded
    trace; the page skips them unread (no main-thread task holds a quarter of the thread's CPU over the run, as
    parsing one would: a share, not milliseconds, which a loaded machine stretches), draws every step after
    them, and its heap stays small (the lines are not kept)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from minipaged import web

    header, *steps = TRACE.read_text().splitlines()
    steps = [json.loads(line) for line in steps]
    arrival = {"request_id": "huge.0", "prompt_len": 500000, "max_tokens": 1, "prompt": "=" * 500_000}
    huge = {**steps[0], "step": 0, "arrivals": [{**arrival, "request_id": f"huge.{i}"} for i in range(128)],
            "kv": {}, "scheduled": [], "new_token_ids": {}, "new_text": {}, "finished": []}
    huge_line = f"data: {json.dumps(huge)}\n\n".encode()
    assert len(huge_line) > 64_000_000

    class OldServer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:          # noqa: N802
            if self.path.startswith("/v1/events"):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                self.wfile.write(f"data: {header}\n\n".encode())
                self.wfile.flush()
                go.wait(30)                                     # the test is tracing the page
                for i, step in enumerate(steps):
                    if i in (5, 20, 40):
                        self.wfile.write(huge_line)
                    self.wfile.write(f"data: {json.dumps(step)}\n\n".encode())
                self.wfile.flush()
                time.sleep(60)                                  # a quiet stream, not a lost one
                return
            found = (web.index_html().encode(), "text/html") if self.path.split("?")[0] == "/" else \
                web.static_file(self.path.rsplit("/", 1)[-1])
            if found is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", found[1])
            self.end_headers()
            self.wfile.write(found[0])

        def log_message(self, *args) -> None:
            pass

    go = threading.Event()
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), OldServer)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    last = steps[-1]["step"]

    async def run() -> dict:
        async with open_page(f"http://127.0.0.1:{httpd.server_address[1]}/") as page:
            await wait_for(page, "!!(window.minipaged && window.minipaged.view.info)", "the page never started")
            await start_tracing(page)
            go.set()
            await wait_for(page, f"window.minipaged.head.step === {last}", "the page stopped before the last step",
                           timeout_s=60)
            await asyncio.sleep(0.5)
            tasks = await main_thread_tasks(page)
            return {"longest_cpu": max(cpu for _wall, cpu in tasks), "longest_share": longest_task_share(tasks),
                    "heap": await heap_mb(page),
                    "huge_seen": await evaluate(page, "window.minipaged.head.requests.has('huge.0')"),
                    "connected": await evaluate(page, "window.minipaged.view.connected")}

    try:
        seen = asyncio.run(run())
    finally:
        httpd.shutdown()
        httpd.server_close()
    print("page under 64 MB lines:", seen)
    assert seen["longest_share"] < 0.25, seen                    # of the main thread's CPU
    assert seen["heap"] < 32, seen                               # MB, after three 64 MB lines
    assert not seen["huge_seen"] and seen["connected"], seen
