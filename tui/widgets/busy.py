"""Why the GPU waits, drawn: how busy the device kept (on a CPU: how much of each step was the forward pass), and
a lane of the recent steps, each a column, split into the host's share of its wall time and the device's.

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
    """Two rows over the last ``width`` steps, oldest on the left: the busy share of each step (the device's, or
    the forward pass's on a CPU) and the host's share. Without async scheduling the two add up to the step; with
    it they overlap (the host works while the device computes), which is the point of it."""
    recent = list(state.lane)[-width:]
    busy_name = "device" if state.busy_label == "device" else "forward"
    text = Text()
    text.append(f"{busy_name:<8}", style="dim")
    text.append("".join(bar(busy) for _host, busy in recent), style=BUSY_COLOUR)
    text.append("\n")
    text.append(f"{'host':<8}", style="dim")
    text.append("".join(bar(host) for host, _busy in recent), style=HOST_COLOUR)
    return text
