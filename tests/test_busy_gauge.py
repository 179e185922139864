"""Why the GPU waits (issue 37 item 7): each StepEvent carries its host time, its forward time and (on CUDA) its
device time; the TUI and the web page show a "busy" gauge and a lane of recent steps from them.

On a CPU the forward pass is computed by the host itself, so ``device_s`` is None and the gauge is labelled
"forward"; the CUDA timer (CUDA events, kernels/backends/forward_timer.py) is checked under ``pytest -m gpu``.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest
import torch

from minipaged import SamplingParams
from minipaged.event_view import busy_label, busy_seconds
from minipaged.events import StepEvent
from minipaged.kernels.backends.forward_timer import CudaForwardTimer, ForwardTimer
from minipaged.trace import read_trace, write_trace_event, write_trace_header
from minipaged.tui.state import WatchState

PROMPTS = [[3 + i] * (6 + 3 * i) for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def run(engine) -> list[StepEvent]:
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    engine.generate(PROMPTS, GREEDY)
    return events


def test_a_step_is_host_time_plus_forward_time_and_a_cpu_has_no_device_time(tiny_engine_factory):
    events = run(tiny_engine_factory(max_num_batched_tokens=32))
    computed = [ev for ev in events if ev.scheduled]
    assert len(computed) >= 16
    for ev in computed:
        assert ev.device_s is None and busy_label(ev) == "forward"
        assert 0 < ev.forward_s <= ev.model_s, ev      # the forward call alone; model_s adds logits and sampling
        assert ev.host_s > 0
        # Without async output processing the step is host work, then the forward pass: they add up to it
        # (rounded to 1 us).
        assert abs(ev.host_s + ev.forward_s - ev.duration_s) < 2e-6 + 1e-9 * ev.duration_s, ev
        assert ev.host_s >= ev.schedule_s - 2e-6     # host_s also counts sampling, which schedule_s leaves out
    # Compact: three short numbers a step (rounded to the microsecond), and they survive JSON.
    again = StepEvent.from_dict(json.loads(computed[-1].to_json()))
    assert (again.host_s, again.forward_s, again.device_s) == (computed[-1].host_s, computed[-1].forward_s, None)
    assert len(repr(computed[-1].forward_s)) <= 10


def test_with_async_output_processing_the_host_works_while_the_forward_runs(tiny_engine_factory):
    events = run(tiny_engine_factory(max_num_batched_tokens=32, async_output_processing=True))
    computed = [ev for ev in events if ev.scheduled]
    assert computed and all(ev.forward_s > 0 and ev.host_s > 0 and ev.device_s is None for ev in computed)
    # The forward pass ran in the model thread beside the host's work: the host's time is the engine thread's
    # (schedule_s: the step() call but its wait for the model thread) plus the model thread's own outside the
    # forward (the batch's tensors, the logits stage, sampling), not the step's time less the forward's.
    for ev in computed:
        assert ev.host_s >= ev.schedule_s + (ev.model_s - ev.forward_s) - 2e-6, ev
    # The forwards ran one after another within the run: together no longer than the steps' wall time.
    assert sum(ev.forward_s for ev in events) <= sum(ev.duration_s for ev in events)


def test_the_backend_times_forwards_on_the_hosts_clock_on_a_cpu(tiny_engine_factory):
    engine = tiny_engine_factory()
    timer = engine.backend.forward_timer(torch.device("cpu"))
    assert type(timer) is ForwardTimer and engine.runner.forward_timer.device_seconds() is None
    timer.start()
    time.sleep(0.01)
    timer.stop()
    assert 0.009 < timer.host_s < 1.0 and timer.device_seconds() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_time_comes_from_cuda_events():
    """The device's time covers the kernels, not the launching: a matmul chain launched far faster than it runs
    is timed at its run time (the wall time until the GPU is done, less the launches' head start)."""
    timer = CudaForwardTimer()
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    begin = time.perf_counter()
    timer.start()
    for _ in range(20):
        x = x @ x
        x = x / x.norm()
    timer.stop()
    torch.cuda.synchronize()
    wall = time.perf_counter() - begin
    device = timer.device_seconds()
    assert timer.host_s < device <= wall + 1e-3, (timer.host_s, device, wall)
    assert device > 0.5 * wall


def event(n: int, duration: float, host: float, forward: float, device=None) -> StepEvent:
    return StepEvent(step=n, time_s=n * duration, duration_s=duration, schedule_s=host, model_s=forward,
                     budget_limit=8, budget_used=1, max_num_seqs=4, host_s=host, forward_s=forward, device_s=device)


def test_the_gauge_is_the_busy_share_of_recent_wall_time_and_the_lane_each_steps(tiny_engine_factory):
    info = tiny_engine_factory().info
    state = WatchState(info)
    state.apply(event(1, 0.1, 0.09, 0.01))                    # a host-bound step: busy 10%
    state.apply(event(2, 0.1, 0.01, 0.09))                    # a forward-bound one: 90%
    assert state.busy_label == "forward"
    assert state.device_busy.history[-1] == pytest.approx(0.5)     # (0.01 + 0.09) / 0.2
    assert list(state.lane) == [pytest.approx((0.9, 0.1)), pytest.approx((0.1, 0.9))]
    # On CUDA the device's time counts, not the launching (forward_s): the label says "device".
    state.apply(event(3, 0.1, 0.095, 0.005, device=0.03))
    assert busy_seconds(state.last_event) == 0.03 and state.busy_label == "device"
    assert state.lane[-1] == pytest.approx((0.95, 0.3))
    # A trace recorded before steps carried these times draws no gauge (nothing to show is not "0% busy").
    old = WatchState(info)
    old.apply(StepEvent(step=1, time_s=0.1, duration_s=0.1, schedule_s=0.0, model_s=0.1, budget_limit=8,
                        budget_used=1, max_num_seqs=4))
    assert not old.lane and not old.device_busy.history


def record(engine, path) -> list[StepEvent]:
    events = run(engine)
    with open(path, "w") as fp:
        write_trace_header(fp, engine.info)
        for ev in events:
            write_trace_event(fp, ev)
    return events


def test_the_tui_shows_the_busy_gauge_and_lane_only_when_steps_carry_times(tiny_engine_factory, tmp_path):
    from pathlib import Path

    from rich.style import Style

    from minipaged.tui.app import WatchApp
    from minipaged.tui.widgets.busy import BARS, BUSY_COLOUR, HOST_COLOUR, bar
    from minipaged.tui.widgets.gauges import Gauges

    trace = tmp_path / "run.jsonl"
    record(tiny_engine_factory(max_num_batched_tokens=32), trace)
    committed = Path(__file__).parent / "data" / "watch_trace.jsonl"     # recorded before steps carried times

    async def look(path) -> dict:
        app = WatchApp(replay=read_trace(str(path)), paused=True)
        async with app.run_test(size=(120, 40)) as pilot:
            app.go_to(len(app.events))
            await pilot.pause()
            gauges = app.query_one(Gauges)
            lane = gauges.query_one("#busy-lane")
            seen = {"shown": gauges.query_one("#gauge-busy").parent.display,
                    "title": str(gauges.query_one("#busy-title").render()),
                    "value": str(gauges.query_one("#gauge-busy").render()),
                    "lane": lane.render(), "state": app.state}
            await pilot.press("q")
        return seen

    seen = asyncio.run(look(trace))
    assert seen["shown"] and seen["title"] == "forward", seen
    share = seen["state"].device_busy.last
    assert 0 < share <= 1 and f"{share * 100:5.1f} %" == seen["value"]
    # The lane: a cell per recent step (as many as fit), its height the step's forward share, over the host's colour.
    lane, steps = seen["lane"], list(seen["state"].lane)
    assert 10 <= len(lane.plain) <= len(steps) and set(lane.plain) <= set(BARS), lane.plain
    assert lane.plain == "".join(bar(busy) for _host, busy in steps[-len(lane.plain):])
    colours = {(s.color.triplet, s.bgcolor.triplet) for s in (Style.parse(str(span.style)) for span in lane.spans)}
    wanted = Style.parse(f"{BUSY_COLOUR} on {HOST_COLOUR}")
    assert colours == {(wanted.color.triplet, wanted.bgcolor.triplet)}, colours
    assert not asyncio.run(look(committed))["shown"]


def test_the_page_shows_the_busy_gauge(tiny_engine_factory, tmp_path):
    from browser_util import INSTALL_HINT, evaluate, find_chromium, open_page, wait_for

    if find_chromium() is None:
        pytest.skip(f"no headless Chromium: {INSTALL_HINT} (.ci/run installs it)")
    trace, page_file = tmp_path / "run.jsonl", tmp_path / "run.html"
    events = record(tiny_engine_factory(max_num_batched_tokens=32), trace)
    done = subprocess.run([sys.executable, "-m", "minipaged", "export-html", str(trace), "-o", str(page_file)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    expected = WatchState.from_events(read_trace(str(trace))[0], events)

    async def look() -> dict:
        async with open_page(page_file.as_uri(), offline=True) as page:
            await wait_for(page, "!!document.getElementById('busy-value')", "the page never drew the busy gauge", 30)
            await evaluate(page, """(() => { const s = document.getElementById('slider');
                s.value = s.max; s.dispatchEvent(new Event('input')); })()""")     # a replay opens at its first step
            await wait_for(page, f"window.minipaged.state.step === {len(events)}",
                           "the slider did not reach the last step", 30)
            await asyncio.sleep(0.2)
            return {"text": await evaluate(page, "document.getElementById('busy').textContent"),
                    "value": await evaluate(page, "document.getElementById('busy-value').textContent"),
                    "columns": await evaluate(page, "document.querySelectorAll('#busy .busy-lane.busy > div').length"),
                    "hosts": await evaluate(page, "document.querySelectorAll('#busy .busy-lane.host > div').length"),
                    "height": await evaluate(page, "document.querySelector('#busy .busy-lane').getBoundingClientRect()"
                                                   ".height"),
                    "colour": await evaluate(page, "getComputedStyle(document.querySelector("
                                                   "'#busy .busy-lane.busy > div')).backgroundColor")}

    seen = asyncio.run(look())
    assert seen["text"].startswith("forward") and "host" in seen["text"], seen
    assert seen["value"] == f"{expected.device_busy.last * 100:.0f}%", seen
    assert seen["columns"] == seen["hosts"] == len(expected.lane) > 0, seen
    assert seen["height"] > 10 and seen["colour"] == "rgb(89, 161, 79)", seen      # its block in style.css applies
