"""The selected request's output, streaming in token by token (from ``StepEvent.new_text``).

Above them, kept in view while the output scrolls: what the prefix cache said when the request was admitted
(how many full blocks hit, and why the first miss missed: ``ScheduledRequest.prefix_lookup``).

A request that asked for log-probabilities has its output coloured by how likely the model found each
step's tokens (``StepEvent.new_logprobs``: the raw model's probabilities), from green (likely) to red.
"""
from __future__ import annotations

from typing import Optional, Sequence

from rich.text import Text
from textual.widget import Widget

from minipaged.events import describe_prefix_lookup

from ..state import WatchState, clean_preview, printable

PROMPT_CHARS = 150         # the prompt above the output: its start and end, like the request table's
# (lowest probability, colour): the first row whose bound the probability reaches
PROBABILITY_COLOURS = ((0.5, "#59a14f"), (0.2, "#8cd17d"), (0.05, "#edc948"), (0.01, "#f28e2b"), (0.0, "#e15759"))


def probability_colour(probability: Optional[float]) -> str:
    if probability is None:
        return ""
    return next(colour for bound, colour in PROBABILITY_COLOURS if probability >= bound)


def coloured_output(text: str, spans: Sequence[tuple[int, Optional[float]]]) -> Text:
    """The output, each step's characters in the colour of their probability (spans cover the text in order)."""
    out = Text()
    start = 0
    for length, probability in spans:
        piece = printable(text[start:start + length])
        start += length
        if piece:
            out.append(piece, style=probability_colour(probability))
    out.append(printable(text[start:]))
    return out


class OutputPanel(Widget):
    """Shows the tail of the selected request's text, like a terminal that follows new output."""

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id)
        self.state: Optional[WatchState] = None
        self.request_id: Optional[str] = None
        self.border_title = "Output"

    def show(self, state: Optional[WatchState], request_id: Optional[str]) -> None:
        self.state, self.request_id = state, request_id
        self.refresh()

    def render(self) -> Text:
        state, rid = self.state, self.request_id
        if state is None or rid is None or rid not in state.view.requests:
            self.border_title = "Output"
            return Text("select a request (arrow keys or click) to follow its output", style="dim")
        req = state.view.requests[rid]
        self.border_title = f"Output of {state.short_name(rid)} ({req.state}, {req.num_output_tokens}/{req.max_tokens} tokens)"
        text = Text()
        text.append(clean_preview(req.prompt, PROMPT_CHARS) + "\n", style=f"italic {state.colour(rid)}")
        if req.text_probs:
            text.append_text(coloured_output(req.text, req.text_probs))
        else:
            text.append(printable(req.text) or "...")
        if req.finish_reason:
            text.append(f"  [{req.finish_reason}]", style="dim")
        width = max(10, self.content_size.width)
        height = max(1, self.content_size.height)
        lines = list(text.wrap(self.app.console, width))
        if req.prefix_lookup is not None:
            note = Text("prefix cache: " + describe_prefix_lookup(req.prefix_lookup),
                        style="#7d8fa3")
            pinned = list(note.wrap(self.app.console, width))
            if 2 * len(pinned) <= height:           # kept in view above the output's tail, while it fits
                return Text("\n").join(pinned + lines[max(0, len(lines) - (height - len(pinned))):])
            lines = pinned + lines
        return Text("\n").join(lines[-height:])
