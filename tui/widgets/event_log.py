"""The event log, newest first: admissions, prefill chunks, cache hits, evictions, preemptions, swaps,
finishes. The lines come from ``state.describe_event``, so the ``--no-tui`` log says the same words."""
from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual.widget import Widget

from ..state import WatchState, printable

ICONS = {"arrive": ("+", "#a0cbe8"), "admit": ("▶", "#59a14f"), "chunk": ("▤", "#c9c9c9"),
         "hit": ("♻", "#7d8fa3"), "evict": ("✗", "#e15759"), "preempt": ("⚠", "#f28e2b"),
         "swap": ("⇄", "#b07aa1"), "finish": ("■", "#888888"), "spec": ("⚡", "#76b7b2"),
         "mask": ("▦", "#edc948")}


class EventLog(Widget):
    """As many of the latest log lines as fit, the newest on top."""

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id)
        self.state: Optional[WatchState] = None
        self.border_title = "Events (newest first)"

    def show(self, state: Optional[WatchState]) -> None:
        self.state = state
        self.refresh()

    def render(self) -> Text:
        if self.state is None or not self.state.log:
            return Text("nothing yet", style="dim")
        height = max(1, self.content_size.height)
        width = max(10, self.content_size.width)
        text = Text()
        for i, line in enumerate(reversed(self.state.log)):
            if i >= height:
                break
            if i:
                text.append("\n")
            icon, colour = ICONS.get(line.kind, ("·", "white"))
            text.append(f"{line.step:>4} ", style="dim")
            text.append(icon + " ", style=colour)
            body = printable(self.state.named(line))      # a request's name, as every view says it
            room = width - 7
            if len(body) > room:                   # one line per event: cut, do not wrap
                body = body[:room - 1] + "…"
            if line.request_id:
                head, _, tail = body.partition(" ")
                if head == self.state.short_name(line.request_id):
                    text.append(head, style=f"bold {self.state.colour(line.request_id)}")
                    body = " " + tail
            text.append(body)
        return text
