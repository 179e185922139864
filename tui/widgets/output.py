"""The selected request's output, streaming in token by token (from ``StepEvent.new_text``)."""
from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual.widget import Widget

from ..state import WatchState, clean_preview, printable

PROMPT_CHARS = 150         # the prompt above the output: its start and end, like the request table's


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
        self.border_title = f"Output of {rid} ({req.state}, {req.num_output_tokens}/{req.max_tokens} tokens)"
        text = Text()
        text.append(clean_preview(req.prompt, PROMPT_CHARS) + "\n", style=f"italic {state.colour(rid)}")
        text.append(printable(req.text) or "...")
        if req.finish_reason:
            text.append(f"  [{req.finish_reason}]", style="dim")
        width = max(10, self.content_size.width)
        height = max(1, self.content_size.height)
        lines = text.wrap(self.app.console, width)
        return Text("\n").join(list(lines)[-height:])
