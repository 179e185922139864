"""The request table: running, swapped, waiting and finished requests with their progress.

A request's life in one row: its prompt's KV being computed (prefill, maybe in chunks, maybe partly from
the prefix cache), then one generated token per step (decode), until it finishes. Preemption sends it back
to waiting (recompute) or to the swapped queue. Move the cursor to select a request: its blocks light up in
the map and its text streams in the output panel.
"""
from __future__ import annotations

from typing import Optional

from rich.text import Text
from textual import events
from textual.message import Message
from textual.widgets import DataTable

from ..state import WatchState, clean_preview

MIN_PROMPT_WIDTH = 16
DEFAULT_PROMPT_WIDTH = 60
STATE_STYLE = {"running": "bold #59a14f", "waiting": "#edc948", "swapped": "#b07aa1", "finished": "dim"}


def progress(done: int, total: int, width: int = 6) -> str:
    """A small text bar: how much of ``total`` is done."""
    total = max(total, 1)
    filled = min(width, round(done / total * width))
    return "▰" * filled + "▱" * (width - filled)


class RequestTable(DataTable):
    """One row per request; the cursor shows the selected request.

    The app owns the selection (arrow keys, clicks here or on the block map): the table never takes focus
    and only reports clicks, so that rebuilding its rows every step cannot change what is selected.
    """

    can_focus = False

    class Selected(Message):
        def __init__(self, request_id: str) -> None:
            self.request_id = request_id
            super().__init__()

    COLUMNS = ("", "id", "state", "prompt KV", "output", "blocks", "cached", "pre", "prompt")

    def __init__(self, *, id: Optional[str] = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)
        self._rows: list[str] = []

    def on_mount(self) -> None:
        self.add_columns(*self.COLUMNS)
        self.border_title = "Requests"

    def show(self, state: Optional[WatchState], selected: Optional[str]) -> None:
        """Rebuild the rows (cheap at workshop scale) and put the cursor on the selection."""
        self.clear()
        self._rows = []
        if state is None:
            return
        q = state.queues()
        counts = ", ".join(f"{len(q[k])} {k}" for k in ("running", "waiting", "swapped", "finished") if q[k])
        self.border_title = f"Requests: {counts}" if counts else "Requests"
        rows = []
        for rid in state.ordered_requests():
            r = state.view.requests[rid]
            prompt_done = min(r.num_computed, r.prompt_len)
            blocks = str(len(r.blocks)) if r.blocks else (f"{len(r.cpu_blocks)} host" if r.cpu_blocks else "")
            rows.append((rid, r.prompt, [
                Text("██", style=state.colour(rid)), Text(state.short_name(rid)), Text(r.state, style=STATE_STYLE.get(r.state, "")),
                Text(f"{progress(prompt_done, r.prompt_len, 4)} {prompt_done:>4}/{r.prompt_len}"),
                Text(f"{r.num_output_tokens:>3}/{r.max_tokens}"), Text(blocks), Text(str(r.num_cached_tokens or "")),
                Text(str(r.num_preemptions or ""))]))
        prompt_width = self._prompt_width([cells for _rid, _preview, cells in rows])
        for rid, preview, cells in rows:
            self.add_row(*cells, clean_preview(preview, prompt_width), key=rid)
            self._rows.append(rid)
        if selected in self._rows:
            self.move_cursor(row=self._rows.index(selected), animate=False, scroll=True)

    def _prompt_width(self, rows: list[list[Text]]) -> int:
        """The room the other columns leave for the prompt, so that a long preview is shortened in its
        middle, keeping the end that tells prompts with a shared start apart, instead of being cut off at the
        end by the table. (The table itself learns its column widths only when it next draws.)"""
        if not self.content_size.width:
            return DEFAULT_PROMPT_WIDTH                     # not laid out yet
        widths = [max([len(label)] + [cells[i].cell_len for cells in rows]) for i, label in
                  enumerate(self.COLUMNS[:-1])]
        others = sum(widths) + 2 * self.cell_padding * len(self.COLUMNS)
        return max(MIN_PROMPT_WIDTH, self.content_size.width - others - 1)

    async def _on_click(self, event: events.Click) -> None:
        row = event.style.meta.get("row")
        if isinstance(row, int) and 0 <= row < len(self._rows):
            self.post_message(self.Selected(self._rows[row]))
        event.stop()
