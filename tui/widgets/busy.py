"""Why the GPU waits, drawn: how busy the device kept (on a CPU: how much of each step was the forward pass), and
a lane of the recent steps, a cell each, split into the device's share of its wall time and the host's.

Issue 37 measured an engine that kept an H200 busy 11% of each decode step: the rest was Python (scheduling,
preparing inputs, launching 707 kernels, turning tokens into text). The gauge shows that share live, from the
times each StepEvent carries (``host_s``, ``forward_s``, ``device_s``; ``WatchState.device_busy`` and ``lane``);
lessons/lesson10_gpu_waits.md explains what moves it. The web page draws the same (minipaged/web/static/busy.mjs).
"""
from __future__ import annotations

from rich.text import Text

from ..state import WatchState

BARS = " ▁▂▃▄▅▆▇█"               # a share of a step, in eighths of a cell
BUSY_COLOUR = "#59a14f"           # the device (or the forward pass) at work
HOST_COLOUR = "#f28e2b"           # the host's own work: the device waits for it


def bar(share: float) -> str:
    """One cell whose filled height is ``share`` (0..1) of it."""
    return BARS[max(0, min(len(BARS) - 1, round(share * (len(BARS) - 1))))]


def busy_title(state: WatchState) -> str:
    """The gauge's name: "device busy" where the device was timed (CUDA events), "forward" on a CPU."""
    return "device busy" if state.busy_label == "device" else "forward"


def lane_text(state: WatchState, width: int = 40) -> Text:
    """The last ``width`` steps, oldest on the left, one cell each: the lower part (green) is the share of the step
    the device was busy (on a CPU: the forward pass), the rest (orange) the host's, while the device waited. With
    async output processing the host works while the device computes, so the host's share is what is left uncovered."""
    text = Text()
    for _host, busy in list(state.lane)[-width:]:
        text.append(bar(busy), style=f"{BUSY_COLOUR} on {HOST_COLOUR}")
    return text
