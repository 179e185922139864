"""The web page's event fold (minipaged/web/static/fold.mjs) equals Python's WatchState at every step.

Traces are recorded here on the tiny model with prefix hits, chunked prefill, recompute and swap
preemption, an abort, speculative drafts and a late watcher's snapshot; Python folds them step by step and
node's built-in test runner folds the same events with the page's JavaScript and compares (tests/web/).
"""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from minipaged import SamplingParams, StructuredOutputsParams
from minipaged.events import StepEvent, describe_prefix_lookup
from minipaged.event_view import snapshot_event
from minipaged.tui.state import FINISHED_KEPT, WatchState

NODE = shutil.which("node")
HERE = Path(__file__).parent
METRICS = ("kv_usage", "hit_rate", "tokens_per_s", "step_ms", "ttft_ms", "itl_ms", "acceptance_rate",
           "acceptance_length", "device_busy")


def comparable(state: WatchState) -> dict[str, Any]:
    """Python's fold in the JSON shape of fold.mjs's ``comparable``."""
    view = state.view
    return {
        "step": view.step, "num_events": state.num_events,
        "block_owners": [sorted(o) for o in view.block_owners], "block_cached": list(view.block_cached),
        "cpu_block_owner": list(view.cpu_block_owner),
        "requests": {rid: asdict(r) for rid, r in view.requests.items()},
        "colours": dict(state.colours), "short_names": dict(state.short_names), "arrival_order": list(state.arrival_order), "queues": state.queues(),
        "ordered_requests": state.ordered_requests(),
        "used_blocks": sum(1 for o in view.block_owners if o),
        "log": [[line.step, line.kind, line.text, line.request_id] for line in state.log],
        "lookups": {rid: r.prefix_lookup and describe_prefix_lookup(r.prefix_lookup)
                    for rid, r in view.requests.items()},
        "metrics": {name: list(getattr(state, name).history) for name in METRICS},
        "lane": [list(pair) for pair in state.lane], "busy_label": state.busy_label,
    }


def prompts(seed: int, n: int, shared: int = 24) -> list[list[int]]:
    """Half the prompts share a system prefix (prefix hits); lengths vary (uneven chunks)."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(shared)]
    return [(system if i % 2 == 0 else []) + [rng.randrange(256) for _ in range(rng.randint(3, 30))]
            for i in range(n)]


def record(engine, workload: list[list[int]], params: SamplingParams, abort_at: int = -1) -> list[StepEvent]:
    """Run ``workload``, two new requests a step; abort the second one at step ``abort_at``."""
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    pending, ids = list(workload), []
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                ids.append(engine.add_request(pending.pop(0), params))
        if len(events) == abort_at:
            engine.abort(ids[1])
        engine.step()
    return events


def case(name: str, info, events: list[StepEvent]) -> dict[str, Any]:
    state = WatchState(info)
    expected = []
    for ev in events:
        state.apply(ev)
        expected.append(comparable(state))
    return {"name": name, "info": asdict(info), "events": [json.loads(ev.to_json()) for ev in events],
            "expected": expected}


@pytest.fixture(scope="module")
def traces(tiny_engine_factory) -> dict[str, tuple[Any, list[StepEvent]]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = {}
    engine = tiny_engine_factory(num_blocks=24, preemption_mode="recompute", max_num_batched_tokens=16)
    out["prefix-chunked-recompute-abort"] = engine.info, record(engine, prompts(0, 10), greedy, abort_at=3)
    engine = tiny_engine_factory(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, max_num_batched_tokens=20,
                                 eviction_policy="mru")      # the log names the eviction order the engine used
    out["swap"] = engine.info, record(engine, prompts(1, 10), greedy)
    engine = tiny_engine_factory(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    repetitive = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [9, 10], [1, 2, 3, 1, 2, 3, 4, 1, 2]]
    out["speculative"] = engine.info, record(engine, repetitive, SamplingParams(temperature=0.0, max_tokens=20,
                                                                                 ignore_eos=True))
    # Log-probabilities colour a request's text; a structured-output mask is logged (the logits stage).
    engine = tiny_engine_factory()
    scored = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    masked = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no"]))
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    for prompt, params in zip(prompts(2, 3), [scored, masked, greedy]):
        engine.add_request(prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    out["logprobs-and-mask"] = engine.info, events
    # n samples share one prompt, sent once (prompt_of); more finished requests than either fold remembers.
    engine = tiny_engine_factory(max_num_seqs=64)
    events = []
    engine.subscribe(events.append)
    # Ids as a server names them (long: the page calls them r0, r1 ...), the engine's own numbers, a short id "r1"
    # that a generated name must step over, and a short id "r0" that a generated name already holds.
    names = [f"chatcmpl-{0:024x}", "r1", f"cmpl-{2:024x}", None, "r0", None, f"chatcmpl-{6:024x}", f"cmpl-{7:024x}"]
    for i in range(8):
        engine.add_request([3 + i] * (5 + i), SamplingParams(n=32 if i < 7 else 1, temperature=1.0, seed=i,
                                                             max_tokens=2, ignore_eos=True), request_id=names[i])
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    out["samples-share-a-prompt-old-ones-forgotten"] = engine.info, events
    # Async output processing: the forward pass runs beside the host's work (the busy gauge's lane overlaps).
    engine = tiny_engine_factory(async_output_processing=True)
    out["async-output-processing"] = engine.info, record(engine, prompts(3, 6), greedy)
    return out


def test_the_traces_hold_every_feature_the_fold_must_follow(traces):
    events = [ev for _info, evs in traces.values() for ev in evs]
    assert any(s.num_cached_tokens for ev in events for s in ev.scheduled), "no prefix hit"
    assert any(s.kind == "prefill" and s.start > s.num_cached_tokens for ev in events for s in ev.scheduled), \
        "no chunked prefill"
    modes = {p.mode for ev in events for p in ev.preempted}
    assert modes == {"swap", "recompute"}, modes
    assert any(ev.swapped_in for ev in events), "nothing swapped back in"
    assert any(f.finish_reason == "abort" for ev in events for f in ev.finished), "no abort"
    drafts = [s for ev in events for s in ev.scheduled if s.draft_token_ids]
    assert drafts and any(s.num_accepted for s in drafts) and any(s.num_rejected for s in drafts)
    assert any(ev.kv.evicted for ev in traces["swap"][1]), "no eviction under the MRU policy"
    assert any(ev.new_logprobs for ev in events), "no log-probabilities"
    assert any(ev.constrained for ev in events), "no structured-output mask"
    shared = [a for ev in events for a in ev.arrivals if a.prompt_of is not None]
    assert shared and all(a.prompt == "" for a in shared), "no arrival that shares its prompt"
    finished = sum(len(ev.finished) for ev in traces["samples-share-a-prompt-old-ones-forgotten"][1])
    assert finished > FINISHED_KEPT, "nothing old enough to forget"
    assert all(ev.host_s is not None and ev.forward_s is not None and ev.device_s is None for ev in events), \
        "a step without its host and forward times (on a CPU device_s is None)"
    assert any(ev.forward_s for ev in traces["async-output-processing"][1])
    reasons = {s.prefix_lookup.reason for ev in events for s in ev.scheduled if s.prefix_lookup}
    assert {"never", "differs", "evicted", "all_hit"} <= reasons, reasons      # the page says each in words


@pytest.mark.skipif(NODE is None, reason="node (20 or later) is not installed: apt-get install nodejs (.ci/run installs it)")
def test_the_pages_fold_equals_watch_state_at_every_step(traces, tmp_path):
    cases = [case(name, info, events) for name, (info, events) in traces.items()]
    # A watcher that joins mid-run folds the server's snapshot first, then the steps after it.
    info, events = traces["swap"]
    state = WatchState(info)
    for ev in events[:9]:
        state.apply(ev)
    snapshot = snapshot_event(state.view)
    late = WatchState(info)
    late.apply(StepEvent.from_dict(json.loads(snapshot.to_json())))
    assert {r.request_id: r.prefix_lookup for r in late.view.requests.values()} == \
        {r.request_id: r.prefix_lookup for r in state.view.requests.values()}, "a late watcher lost the lookups"
    assert any(r.prefix_lookup for r in late.view.requests.values())
    cases.append(case("late-join-snapshot", info, [snapshot, *events[9:]]))
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    result = subprocess.run([NODE, "--test", str(HERE / "web" / "fold.test.mjs"), str(HERE / "web" / "sse.test.mjs")],
                            env={"MINIPAGED_FOLD_CASES": str(path), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# pass 5" in result.stdout and "# skipped 0" in result.stdout, result.stdout[-2000:]


def test_requests_are_named_as_the_tui_names_them_with_samples_sharing_a_name(traces):
    """A server's long ids read r0, r1 ... in arrival order; short ids keep their own name unless a generated
    name holds it; a request's samples share its name (the page shows these, the full id on hover)."""
    info, events = traces["samples-share-a-prompt-old-ones-forgotten"]
    state, names = WatchState(info), {}
    for ev in events:
        state.apply(ev)
        names.update(state.short_names)
    by_request = {rid.rsplit(".", 1)[0] if "." in rid else rid: name.split(".")[0] for rid, name in names.items()}
    numbers = [rid for rid in by_request if rid.isdigit()]
    assert by_request == {f"chatcmpl-{0:024x}": "r0", "r1": "r1", f"cmpl-{2:024x}": "r2", "r0": "r3",
                          f"chatcmpl-{6:024x}": "r4", f"cmpl-{7:024x}": "r5", **{n: n for n in numbers}}, by_request
    assert len(numbers) == 2
    assert names[f"chatcmpl-{0:024x}.7"] == "r0.7" and names[f"cmpl-{7:024x}"] == "r5"
    # What naming keeps beside the names (so an arrival is named without looking at every name held) follows
    # the requests still shown, forgotten ones gone.
    live = {rid.rsplit(".", 1)[0] if rid.rsplit(".", 1)[-1].isdigit() and "." in rid else rid: name.split(".")[0]
            for rid, name in state.short_names.items()}
    held = state._names
    assert held._base_names == live and sorted(held._names_taken.elements()) == sorted(live.values())


def test_the_engine_names_each_request_once_and_a_late_watcher_says_the_same_names(tiny_engine_factory):
    """A class trial's page opened late called the server's requests r0-r2 while the others said r30: each view
    numbered the arrivals it saw. The engine names each request in its arrival (request_names.py), and a late
    watcher's snapshot carries the names: every view, however late, says the same."""
    from minipaged.event_view import EngineView
    from minipaged.tui.plain import print_run

    engine = tiny_engine_factory()
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    early = [f"cmpl-{i:024x}" for i in range(30)]
    for rid in early:                                         # thirty requests come and go before the late page
        engine.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=2, ignore_eos=True), request_id=rid)
    while engine.has_unfinished_requests():
        engine.step()
    late_ids = [f"chatcmpl-{i:024x}" for i in range(3)] + ["A1"]
    for rid in late_ids:
        engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True), request_id=rid)
    engine.step()
    named = {a.request_id: a.name for ev in events for a in ev.arrivals}
    assert [named[rid] for rid in early[:3]] == ["r0", "r1", "r2"] and named[early[-1]] == "r29"
    assert [named[rid] for rid in late_ids] == ["r30", "r31", "r32", "A1"]      # a short id names itself

    watched_from_start = WatchState(engine.info)
    view = EngineView(engine.info)                             # what serve keeps for late watchers
    for ev in events:
        watched_from_start.apply(ev)
        view.apply(ev)
        for f in ev.finished:
            view.requests.pop(f.request_id, None)
    late = WatchState(engine.info)
    late.apply(StepEvent.from_dict(json.loads(snapshot_event(view).to_json())))
    assert {rid: late.short_name(rid) for rid in late_ids} == {rid: named[rid] for rid in late_ids}
    assert {rid: watched_from_start.short_name(rid) for rid in late_ids} == {rid: named[rid] for rid in late_ids}
    # The TUI's printer (and its widgets) show the name, not the server's id
    import io

    from rich.console import Console
    out = io.StringIO()
    engine.step()
    print_run(Console(file=out, width=200), engine.info, events)
    assert "cmpl-" not in out.getvalue() and "r30" in out.getvalue(), out.getvalue()[-3000:]
