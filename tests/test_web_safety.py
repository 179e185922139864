"""Issue 39: the event stream and the pages stay small and safe whatever one request sends.

An arrival carries a bounded preview of its prompt, once for all its samples; the whole text is fetched on
demand behind the API key; a watcher's backlog counts uncompressed bytes; the pages written for replay keep
their script whatever a prompt contains.
"""
from __future__ import annotations

import json

from minipaged import SamplingParams
from minipaged.events import PREVIEW_GAP, PROMPT_PREVIEW_CHARS, EngineView, StepEvent


def test_an_arrival_carries_a_bounded_preview_once_for_all_its_samples(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=1024)
    prompt = "start of a long prompt " + "=" * 1800 + "and its own end"    # near the tiny model's context
    engine.add_request(prompt, SamplingParams(n=8, max_tokens=1, temperature=1.0), request_id="big")
    event = engine.step()
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
