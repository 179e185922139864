"""The page's step view shows each speculating request's k and its acceptance (minipaged/web/static/spec.mjs),
in the TUI's words: JavaScript's lines against Python's on the records of real runs (the automatic k, which
says each request's next k and acceptance estimate, and a fixed k), through node's test runner."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from minipaged import SamplingParams
from minipaged.events import StepEvent
from minipaged.tui.widgets.batch import auto_k_note

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
