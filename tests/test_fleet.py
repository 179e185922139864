"""``minipaged fleet`` (issue 38): two tiny-model replicas behind sglang-router. Every request the real
``openai`` client sends through the router completes, streamed or not, with or without a model name; with
``cache_aware`` the requests that share a system prompt stay on one replica; the fleet page draws both
replicas' block maps and a request in the colour of the replica that served it; SIGTERM stops everything the
fleet started, and a replica that cannot start stops the fleet with its log.
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import suppress

import httpx
import pytest

from browser_util import (INSTALL_HINT, count_colour, decode_png, evaluate, find_chromium, open_page, screenshot,
                          wait_for)
from minipaged.bench.servers import metric_totals
from serve_util import free_port, openai_client, wait_for_answer, wait_until_idle

needs_router = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                  reason="sglang-router is not installed: pip install -e '.[fleet]' (the test "
                                         "extra, which `make test` and CI install, has it)")
needs_chromium = pytest.mark.skipif(find_chromium() is None, reason=f"no headless Chromium: {INSTALL_HINT}")

SYSTEM_PROMPTS = [f"You are assistant number {i}. " + f"Tenant {i} rules: answer briefly and politely. " * 6
                  for i in range(3)]


def fleet_command(model: str, router_port: int, view_port: int, log_dir: str, serve_args: str) -> list[str]:
    return [sys.executable, "-m", "minipaged", "fleet", "--replicas", "2", "--model", model, "--policy", "cache_aware",
            "--port", str(router_port), "--view-port", str(view_port), "--log-dir", log_dir,
            "--serve-args", serve_args]


def stop_group(proc: subprocess.Popen) -> None:
    """What a test started is stopped whatever happened: the fleet by SIGTERM, and its group killed after."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(20)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(5)


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fleet")
    router_port, view_port = free_port(), free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(logs / "fleet.log", "w") as log:
        proc = subprocess.Popen(fleet_command(tiny_model, router_port, view_port, str(logs),
                                              "--threads 1 --block-size 4 --num-blocks 96 --served-model-name tiny"),
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    view = f"http://127.0.0.1:{view_port}"
    pids: list[int] = []
    try:
        wait_for_answer(proc, view + "/fleet.json", "the fleet", str(logs / "fleet.log"), timeout_s=120)
        layout = httpx.get(view + "/fleet.json", timeout=5).json()
        pids = [r["pid"] for r in layout["replicas"]] + [layout["router_pid"]]
        yield {"router": f"http://127.0.0.1:{router_port}", "view": view, "proc": proc,
               "replicas": [r["url"] for r in layout["replicas"]], "log": logs / "fleet.log", "pids": pids}
    finally:
        stop_group(proc)
        for pid in pids:               # whatever the fleet left (its children lead their own process groups)
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)


def successes(url: str) -> float:
    return metric_totals(url).get("minipaged:request_success_total", 0.0)


def served_by(fleet: dict, send) -> int:
    """Which replica served the one request ``send()`` makes (their finished-request counters tell)."""
    before = [successes(u) for u in fleet["replicas"]]
    send()
    grew = [i for i, u in enumerate(fleet["replicas"]) if successes(u) > before[i]]
    assert len(grew) == 1, f"one request, finished on replicas {grew}"
    return grew[0]


@needs_router
def test_every_request_completes_through_the_router(fleet):
    client = openai_client(fleet["router"])
    messages = [{"role": "user", "content": "hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="count: 1 2 3", max_tokens=6, temperature=0)
    assert text.choices[0].finish_reason == "length" and text.usage.completion_tokens == 6
    streamed = list(client.completions.create(model="tiny", prompt="count: 1 2 3", max_tokens=6, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text.choices[0].text
    # Without a model: the openai client always names one (""), a raw body may leave it out; the router
    # forwards "unknown" for both, and the replica answers for the one model it serves.
    nameless = client.chat.completions.create(model="", messages=messages, max_tokens=5, temperature=0)
    assert nameless.choices[0].message.content == chat.choices[0].message.content and nameless.model == "tiny"
    raw = httpx.post(fleet["router"] + "/v1/chat/completions", timeout=60,
                     json={"messages": messages, "max_tokens": 5, "temperature": 0, "stream": True})
    assert raw.status_code == 200 and raw.text.rstrip().endswith("data: [DONE]")


@needs_router
def test_cache_aware_keeps_a_system_prompt_on_one_replica(fleet):
    client = openai_client(fleet["router"])
    landed: dict[int, set[int]] = {i: set() for i in range(len(SYSTEM_PROMPTS))}
    for user in range(4):
        for tenant, system in enumerate(SYSTEM_PROMPTS):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": f"question {user}?"}]
            landed[tenant].add(served_by(fleet, lambda: client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=2, temperature=0)))
    assert all(len(replicas) == 1 for replicas in landed.values()), landed


@needs_router
@needs_chromium
def test_the_fleet_page_draws_both_replicas_and_a_request_in_its_replica_s_colour(fleet, tmp_path):
    RECT = "(() => {{ const r = document.querySelector('#replica-{} .cells').getBoundingClientRect(); " \
           "return {{x: r.x, y: r.y, width: r.width, height: r.height}}; }})()"

    def region(rgb, rect):
        x, y = int(rect["x"]), int(rect["y"])
        return rgb[y:y + int(rect["height"]), x:x + int(rect["width"])]

    async def run() -> dict:
        async with open_page(fleet["view"] + "/", size=(1400, 1000)) as page:
            deadline = time.monotonic() + 40
            while await evaluate(page, "window.fleet ? window.fleet.fleet.replicas.filter("
                                       "(r) => r.connected && r.state).length : 0") < 2:
                assert time.monotonic() < deadline, "the page never drew both replicas"
                await asyncio.sleep(0.2)
            cells = await evaluate(page, "[0, 1].map((i) => document.querySelectorAll(`#replica-${i} .cell`).length)")
            seen: dict = {"cells": cells}
            ids: list[str] = []
            seen["before"] = [successes(u) for u in fleet["replicas"]]
            enough = threading.Event()
            sender = threading.Thread(target=stream_until, args=(fleet["router"], ids, enough))
            sender.start()
            try:
                while time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    if not ids:
                        continue
                    where = await evaluate(page, f"window.fleet.whereIs('{ids[-1]}')")
                    if where < 0:
                        continue
                    colour = await evaluate(page, f"window.fleet.replicaColour({where})")
                    rgb = decode_png(await screenshot(page))
                    here = count_colour(region(rgb, await evaluate(page, RECT.format(where))), colour)
                    there = count_colour(region(rgb, await evaluate(page, RECT.format(1 - where))), colour)
                    seen.update(where=where, here=here, there=there, rid=ids[-1])
                    if here >= 4 * 300:                   # four 22-pixel cells at least
                        (tmp_path / "fleet.png").write_bytes(await screenshot(page))
                        break
            finally:
                enough.set()
                sender.join(60)
            seen["after"] = [successes(u) for u in fleet["replicas"]]
            # A student's own request, typed in the page: it goes through the router and the page says where.
            wait_idle(fleet["replicas"])
            typed_before = [successes(u) for u in fleet["replicas"]]
            await evaluate(page, "document.getElementById('prompt').value = 'where do I land?'; "
                                 "document.getElementById('prompt-form').requestSubmit(); true")
            while "landed on replica" not in (status := await evaluate(
                    page, "document.getElementById('prompt-status').textContent")):
                assert time.monotonic() < deadline + 30, f"the page never said where the request landed: {status!r}"
                await asyncio.sleep(0.2)
            seen["status"] = status
            wait_idle(fleet["replicas"])
            seen["typed_on"] = [i for i in (0, 1) if successes(fleet["replicas"][i]) > typed_before[i]]
            seen["mine"] = await evaluate(page, "[...window.fleet.fleet.mine].map((rid) => window.fleet.whereIs(rid))")
            return seen

    seen = asyncio.run(run())
    assert seen["cells"] == [96, 96], seen
    assert seen.get("here", 0) >= 1200 and seen["there"] == 0, (seen, f"screenshot {tmp_path}")
    # The replicas' own counters agree: the same prompt each time, so cache_aware sent every one to one replica
    grew = [i for i in (0, 1) if seen["after"][i] > seen["before"][i]]
    assert grew == [seen["where"]], seen
    assert seen["mine"] == seen["typed_on"] and f"landed on replica {seen['mine'][0]}" in seen["status"], seen


def wait_idle(urls: list[str]) -> None:
    for url in urls:
        wait_until_idle(url)


def stream_until(router: str, ids: list[str], enough: threading.Event, most: int = 20) -> None:
    """Long streaming requests through the router one after another until ``enough``; ``ids`` gets each one's
    id as its first chunk arrives (the replica's own request id: the router passes it through)."""
    import json
    for _ in range(most):
        if enough.is_set():
            return
        body = {"model": "tiny", "prompt": "fill the blocks " * 4, "max_tokens": 300, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", router + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and not (ids and ids[-1] == json.loads(line[6:])["id"]):
                    ids.append(json.loads(line[6:])["id"])


@needs_router
def test_worker_urls_are_routed_to_and_left_running(fleet, tmp_path):
    """A second fleet over the first one's replicas: it starts only a router, and stops only that."""
    router_port, view_port = free_port(), free_port()
    command = [sys.executable, "-m", "minipaged", "fleet", "--worker-urls", *fleet["replicas"], "--policy",
               "round_robin", "--port", str(router_port), "--view-port", str(view_port), "--log-dir", str(tmp_path)]
    with open(tmp_path / "fleet.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_answer(proc, f"http://127.0.0.1:{view_port}/fleet.json", "the second fleet", str(tmp_path / "fleet.log"))
        client = openai_client(f"http://127.0.0.1:{router_port}")
        landed = {served_by(fleet, lambda: client.completions.create(model="tiny", prompt="same prompt", max_tokens=2))
                  for _ in range(4)}
        assert landed == {0, 1}                         # round_robin: both replicas, whatever the prompt
    finally:
        stop_group(proc)
    assert proc.returncode == 0
    for url in fleet["replicas"]:                       # not started by it: not stopped by it
        assert httpx.get(url + "/health", timeout=5).status_code == 200


# Every visible text's font size in px, and whether the page scrolls (the projector layout's checks).
TEXTS = """(() => {
  const se = document.scrollingElement, sizes = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const e = n.parentElement, r = e && e.getBoundingClientRect();
    if (!n.textContent.trim() || !e || e.offsetParent === null || r.bottom <= 0 || r.top >= innerHeight) continue;
    sizes.push([parseFloat(getComputedStyle(e).fontSize), n.textContent.slice(0, 30)]);
  }
  return {smallest: sizes.reduce((a, t) => (t[0] < a[0] ? t : a), [1e9, '']),
          scrolls: se.scrollHeight > se.clientHeight + 1 || se.scrollWidth > se.clientWidth + 1};
})()"""


@needs_router
@needs_chromium
def test_a_late_fleet_page_shows_which_replica_each_tenant_landed_on(fleet, tmp_path):
    """Lesson 11's question, in a class trial the fleet page could not answer: requests sent before the page opened
    are listed with their replica and their prompt's start (the tenant's system prompt), in the landed panel and
    under each replica; ?projector=1 fits a 1920x1080 screen in letters a room reads."""
    client = openai_client(fleet["router"])
    sent: list[tuple[int, str, int]] = []                 # (tenant, request id, the replica that served it)
    for tenant in (0, 1):
        for question in range(2):
            messages = [{"role": "system", "content": SYSTEM_PROMPTS[tenant]},
                        {"role": "user", "content": f"question {question}?"}]
            answer: list = []
            where = served_by(fleet, lambda: answer.append(client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=2, temperature=0)))
            sent.append((tenant, answer[0].id, where))
    history = httpx.get(fleet["view"] + "/landed.json", timeout=5).json()["landed"]
    recorded = {entry["request_id"]: entry["replica"] for entry in history}
    assert all(recorded.get(rid) == where for _t, rid, where in sent), (sent, history[:8])

    async def run() -> dict:
        async with open_page(fleet["view"] + "/?projector=1", size=(1920, 1080)) as page:
            ids = [rid for _t, rid, _w in sent]
            await wait_for(page, f"""(() => {{ const lines = [...document.querySelectorAll('#landed li')]
                .map((li) => li.title); return {ids!r}.every((rid) => lines.some((t) => t.startsWith(rid))); }})()""",
                           "the late page never listed the requests sent before it opened", tolerate_errors=True)
            await asyncio.sleep(0.5)
            seen = await evaluate(page, """(() => ({
                landed: [...document.querySelectorAll('#landed li')].map((li) => ({title: li.title,
                    text: li.textContent})),
                here: [0, 1].map((i) => document.querySelector(`#replica-${i} .here`).textContent)}))()""")
            seen.update(await evaluate(page, TEXTS))
            (tmp_path / "fleet-projector.png").write_bytes(await screenshot(page))
            return seen

    seen = asyncio.run(run())
    for tenant, rid, where in sent:
        line = next(line for line in seen["landed"] if line["title"].startswith(rid))
        assert f"replica {where}" in line["text"] and f"You are assistant number {tenant}" in line["text"], line
        assert f"You are assistant number {tenant}" in seen["here"][where], (tenant, where, seen["here"])
    assert not seen["scrolls"] and seen["smallest"][0] >= 18, (seen["scrolls"], seen["smallest"], tmp_path)


@needs_router
def test_sigterm_stops_every_process_the_fleet_started(fleet):
    urls = [*fleet["replicas"], fleet["router"], fleet["view"]]
    fleet["proc"].send_signal(signal.SIGTERM)
    assert fleet["proc"].wait(30) == 0
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)
    for pid in fleet["pids"]:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)              # no process of the groups it started is left
    assert "stopped everything it started" in fleet["log"].read_text()


@needs_router
def test_a_replica_that_cannot_start_stops_the_fleet_with_its_log(tiny_model, tmp_path):
    command = fleet_command(tiny_model, free_port(), free_port(), str(tmp_path), "--num-blocks 0")
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert done.returncode == 1, done.stderr
    assert "replica 0" in done.stderr and "num_blocks must be a positive integer" in done.stderr, done.stderr
    assert "stopped everything it started" in done.stderr


def test_a_missing_router_is_named_with_the_install_line(monkeypatch, capsys):
    from minipaged.cli import main
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_router" else object())
    assert main(["fleet", "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs sglang-router, which is not installed" in err and "pip install 'minipaged[fleet]'" in err

