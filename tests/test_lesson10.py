"""Lesson 10 (why the GPU waits): its scenario's step counts, its timings computed from the events' host and
forward times, its checkpoints, and the stored SmolLM2 / tiny-model figures that the text's claims rest on.
(tests/test_lessons.py checks it with every lesson: placeholders, hand-written numbers, measured.json.)"""
from __future__ import annotations

import json
import logging
import statistics

import pytest

from minipaged.lessons import get_lesson, lesson10_gpu_waits as lesson10, run_variant
from minipaged.lessons.core import SMOLLM2_FILE, Trace, build_lesson_model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    logging.getLogger("minipaged").setLevel(logging.ERROR)
    model = build_lesson_model(str(tmp_path_factory.mktemp("lesson10-model")))
    return {name: run_variant(lesson10.SCENARIO, model, name) for name in lesson10.SCENARIO.variants}


def test_both_runs_compute_the_same_tokens_and_async_events_come_one_step_late(runs):
    v = lesson10.measure(runs)
    sync, late = runs["sync"], runs["async"]
    assert late.info.async_output_processing and not sync.info.async_output_processing
    assert v["same_outputs"] and v["same_schedule"]
    # r0's first token comes from its prefill, each other one from a decode step alone; then the batch together
    assert v["alone_decode_steps"] == v["alone_tokens"] - 1 and v["batch_decode_steps"] == v["batch_tokens"] - 1
    # Async output processing returns an empty event whenever a forward pass has just started and none had ended: at
    # the very start and when the batch arrives after r0's run went idle.
    assert v["async_empty_events"] == 2 and v["async_steps"] == v["sync_steps"] + v["async_empty_events"]
    assert not late.events[0].scheduled and late.events[1].scheduled[0].request_id == lesson10.ALONE


def test_timings_come_from_the_events_host_and_forward_times(runs):
    t = lesson10.timings("tiny", runs, 1e-6)
    alone = lesson10.decode_steps(runs["sync"].events, 1)
    assert t["tiny_sync_alone_forward_us"] == statistics.median(ev.forward_s for ev in alone) / 1e-6
    assert t["tiny_sync_alone_host_us"] == statistics.median(ev.host_s for ev in alone) / 1e-6
    assert t["tiny_sync_alone_busy_pct"] == 100 * statistics.median(ev.forward_s / ev.duration_s for ev in alone)
    for key, value in t.items():
        assert 0 < value < float("inf"), key
        if key.endswith("_pct"):
            assert value <= 100.0 + 1e-6, key
    # Without async output processing host and forward make up the step: their shares add up to (nearly) all of it.
    for phase in lesson10.PHASES:
        assert 95 < t[f"tiny_sync_{phase}_busy_pct"] + t[f"tiny_sync_{phase}_host_pct"] <= 100.5, phase
        assert t[f"tiny_{phase}_async_speedup"] == t[f"tiny_sync_{phase}_step_us"] / t[f"tiny_async_{phase}_step_us"]


def test_checkpoints_tick_where_the_runs_show_them(runs):
    lesson = get_lesson(10)
    text = {i: cp.text for i, cp in enumerate(lesson.checkpoints)}
    by_words = lambda words: next(i for i, t in text.items() if words in t)      # noqa: E731
    sync = runs["sync"]
    tracker = lesson.tracker(sync.info)
    for event in sync.events:
        tracker.feed(event)
    assert tracker.variant == "sync"
    step, detail = tracker.ticked[by_words("decodes alone")]
    assert step == sync.first_scheduled_step(lesson10.ALONE) + 1 and "forward" in detail and "host" in detail
    assert tracker.ticked[by_words("decode in one step")][0] == sync.first_scheduled_step(lesson10.BATCH[0]) + 1
    assert by_words("one step late") not in tracker.ticked              # a checkpoint of the async run only
    # The async one ticks at the second step: the first returned nothing, the second r0's prefill.
    late = lesson.tracker(runs["async"].info)
    for event in runs["async"].events:
        late.feed(event)
    assert late.variant == "async" and late.ticked[by_words("one step late")][0] == 2
    # A trace recorded before events carried host and forward times ticks nothing that needs them.
    trace = Trace(sync.info)
    from dataclasses import replace
    for event in sync.events:
        trace.apply(replace(event, host_s=None, forward_s=None))
        assert not lesson10._alone(trace) and not lesson10._batched(trace)


def test_stored_figures_back_the_text():
    """The text says: SmolLM2's forward pass fills nearly every step on a CPU, the tiny model's much less, and
    less again in the batch; async output processing won little or lost here. measured_smollm2.json must say so."""
    s = json.loads(SMOLLM2_FILE.read_text(encoding="utf-8"))["10"]
    assert s["_source"].startswith("python -m minipaged.lessons --measure-smollm2")
    for phase in lesson10.PHASES:
        assert s[f"smollm2_sync_{phase}_busy_pct"] > 90 > s[f"tiny_sync_{phase}_busy_pct"]
        assert s[f"smollm2_sync_{phase}_host_ms"] < s[f"smollm2_sync_{phase}_forward_ms"]
        assert s[f"smollm2_{phase}_async_speedup"] < 1.2                 # "nothing much to win"
        assert s[f"tiny_{phase}_async_speedup"] < 1.0                    # "costs more than it hides"
    assert s["tiny_sync_batch_busy_pct"] < s["tiny_sync_alone_busy_pct"]
    assert s["tiny_sync_batch_host_us"] > s["tiny_sync_alone_host_us"]
    assert s["smollm2_sync_alone_host_pct"] < 5


def test_a_forward_pass_longer_than_its_step_is_explained_not_shown_over_100_percent():
    """A class trial's lesson 10 with async output processing printed "forward busy 124%": the forward pass that
    ended in a step began in the step before (it runs in the model thread beside the host's work), so it can be
    longer than the step that waited for it. The checkpoint caps the share and says why."""
    from minipaged.events import StepEvent
    from minipaged.lessons.lesson10_gpu_waits import _split

    def event(duration_s: float, forward_s: float, host_s: float) -> StepEvent:
        return StepEvent(step=7, time_s=1.0, duration_s=duration_s, schedule_s=0.0, model_s=forward_s,
                         budget_limit=512, budget_used=1, max_num_seqs=16, host_s=host_s, forward_s=forward_s)

    overlapped = _split(event(0.010, 0.0124, 0.003))
    assert "124%" not in overlapped and "busy 100%" in overlapped, overlapped
    assert "began in the step before" in overlapped and "async output processing" in overlapped, overlapped
    plain = _split(event(0.010, 0.007, 0.003))
    assert plain.endswith("(forward busy 70%)"), plain
