"""The page's step view shows each speculating request's k and its acceptance (minipaged/web/static/spec.mjs),
in the TUI's words: JavaScript's lines against Python's on the records of real runs (the automatic k, which
says each request's next k and acceptance estimate, and a fixed k), through node's test runner."""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page

from minipaged import SamplingParams
from minipaged.events import StepEvent
from minipaged.tui.widgets.batch import auto_k_note
from minipaged.web import self_contained_html

NODE = shutil.which("node")
HERE = Path(__file__).parent
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def python_lines(ev: StepEvent) -> list[str]:
    """What the page should write for ``ev``: the verdict of each decode that drafted, then the TUI's note."""
    lines = []
    for s in ev.scheduled:
        note = auto_k_note(s)
        if s.kind != "decode" or not (s.draft_token_ids or note):
            continue
        drafts = len(s.draft_token_ids)
        verdict = f"k={drafts}: {s.num_accepted}/{drafts} accepted" if drafts else "no drafts"
        lines.append(f"{s.request_id} {verdict}{note}")
    return lines


def run(engine, prompts: list[list[int]]) -> list[StepEvent]:
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return events


@pytest.mark.skipif(NODE is None, reason="node (20 or later) is not installed: apt-get install nodejs (.ci/run installs it)")
def test_the_page_shows_each_requests_k_and_acceptance_as_the_tui_does(tiny_engine_factory, tmp_path):
    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13, 14, 15, 16]]      # repeats: the lookup finds drafts
    events = run(tiny_engine_factory(speculative_config={**NGRAM, "auto_k": True}), prompts)
    events += run(tiny_engine_factory(speculative_config=NGRAM), prompts)
    records = [s for e in events for s in e.scheduled if s.kind == "decode"]
    # the runs hold what the page must say: verdicts, automatic choices with estimates, fixed k (no note)
    assert any(s.draft_token_ids for s in records) and any(s.spec_acceptance is not None for s in records)
    assert any(s.spec_k is None for s in records) and any(s.spec_k is not None for s in records)
    as_json = [json.loads(e.to_json()) for e in events]
    cases = {"records": [{"record": s, "note": auto_k_note(StepEvent.from_dict({**e, "scheduled": [s]}).scheduled[0])}
                         for e in as_json for s in e["scheduled"]],
             "events": [{"event": j, "lines": python_lines(e)} for j, e in zip(as_json, events)]}
    assert any(c["lines"] for c in cases["events"])
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    result = subprocess.run([NODE, "--test", str(HERE / "web" / "spec.test.mjs")],
                            env={"MINIPAGED_SPEC_CASES": str(path), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 2" in result.stdout and "# skipped 0" in result.stdout, result.stdout[-2000:]


@pytest.mark.skipif(find_chromium() is None, reason=f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
def test_the_drawn_page_writes_the_lines_under_the_batch_bar(tiny_engine_factory, tmp_path):
    """The page itself (an exported trace, opened offline in headless Chromium) at a step that verified drafts
    shows each speculating request's line under the batch bar, and hides the box at a step without any."""
    from minipaged.trace import write_trace_event, write_trace_header

    engine = tiny_engine_factory(speculative_config={**NGRAM, "auto_k": True})
    events = run(engine, [[5, 6, 7, 8] * 4, [9, 10, 11] * 5])
    trace = tmp_path / "run.jsonl"
    with open(trace, "w") as fp:
        write_trace_header(fp, engine.info)
        for ev in events:
            write_trace_event(fp, ev)
    page_file = tmp_path / "run.html"
    page_file.write_text(self_contained_html(trace.read_text().splitlines()))
    verifying = next(i for i, e in enumerate(events) if any(s.draft_token_ids for s in e.scheduled))
    quiet = next(i for i, e in enumerate(events) if not python_lines(e))

    async def shown(index: int) -> tuple[str, bool]:
        async with open_page(page_file.as_uri() + f"?step={index}", offline=True) as page:
            deadline = time.monotonic() + 30
            while not await evaluate(page, "!!document.getElementById('spec-text')"):
                assert time.monotonic() < deadline, "the page never drew its batch"
                await asyncio.sleep(0.2)
            return (await evaluate(page, "document.getElementById('spec-text').textContent"),
                    await evaluate(page, "document.getElementById('spec-text').hidden"))

    text, hidden = asyncio.run(shown(verifying))
    assert text.split("\n") == python_lines(events[verifying]) and not hidden, (text, verifying)
    assert asyncio.run(shown(quiet))[1], "a step without speculation still shows the box"
