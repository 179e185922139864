"""The KV block map: every block of the pool as one cell, coloured by the request that owns it.

This is the picture of paged attention: a request's KV cache is not one contiguous slab but a list of
fixed-size blocks anywhere in the pool. Looks:

* a request's colour: the block holds that request's keys and values;
* its colour with "x2", "x3": shared by that many requests (ref count > 1, a prefix-cache hit);
* a grey pattern: free, but still holding a cached prefix that a later prompt may reuse (LRU);
* a dot: free and empty.

When the pool has more blocks than the area has cells, N blocks share a cell (N a power of two) and the
title says so; a partly used cell is drawn partly filled, and "+" marks a full cell holding shared blocks. The
same widget draws the CPU swap pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.color import Color
from textual.message import Message
from textual.strip import Strip
from textual.widget import Widget

from ..state import PALETTE, WatchState

FREE = "#4a4a4a"
CACHED = "#7d8fa3"
MAP_BG = "#121212"
DIM_TOWARDS = Color.parse(MAP_BG)
PARTIAL = " ▂▃▄▅▆▇"        # glyphs for a group cell that is partly in use


@dataclass(frozen=True)
class Cell:
    """What one cell shows: ``size`` blocks (1 unless grouped), starting at block ``first``, summarised."""

    kind: str                  # free, cached, used, shared (GPU) / free, swapped (CPU)
    owner: Optional[str]       # the request whose colour it takes (most blocks in the cell)
    ref_count: int             # highest ref count among its blocks
    used: int                  # how many of its blocks are in use
    size: int
    selected: bool             # holds a block of the selected request
    first: int = 0             # the first block id in the cell


# Roomiest first: (columns per cell including a one-column gap, lines per cell, blank lines between rows).
# Tall cells have room for the block id under the owner's colour, a reminder that a request's blocks
# are wherever the pool had room: its block table lists them.
LOOKS = ((10, 2, 1), (8, 2, 1), (7, 2, 1), (6, 1, 1), (5, 1, 1), (4, 1, 1), (4, 1, 0), (3, 1, 1), (3, 1, 0),
         (2, 1, 0))
# --presenter (a projector at the back of a room): larger cells still, three lines high, tried first.
PRESENTER_LOOKS = ((16, 3, 1), (13, 3, 1), (11, 3, 1)) + LOOKS


@dataclass(frozen=True)
class GridLayout:
    cell_width: int            # columns per cell, the last one a gap
    cols: int                  # cells per row
    cell_height: int           # lines per cell
    row_gap: int               # blank lines between rows of cells
    group: int                 # blocks per cell

    @property
    def pitch(self) -> int:
        return self.cell_height + self.row_gap

    def cell_at(self, x: int, y: int) -> Optional[int]:
        """Index of the cell drawn at content offset (x, y), or None for a gap."""
        if y % self.pitch >= self.cell_height or x % self.cell_width == self.cell_width - 1:
            return None
        col = x // self.cell_width
        return None if col >= self.cols else y // self.pitch * self.cols + col


def choose_layout(num_blocks: int, width: int, height: int,
                  looks: tuple[tuple[int, int, int], ...] = LOOKS) -> GridLayout:
    """The roomiest cells of ``looks`` that fit the whole pool in the area; when even 2-column cells do not
    fit, put several blocks in a cell (a power of two, so "1 cell = 8 blocks" is easy to read)."""
    width, height = max(width, 2), max(height, 1)
    for cell_width, cell_height, gap in looks:
        cols = width // cell_width
        if not cols:
            continue
        rows = -(-num_blocks // cols)
        if rows * (cell_height + gap) - gap <= height:
            return GridLayout(cell_width, cols, cell_height, gap, 1)
    cols = max(1, width // 2)
    group = 2
    while -(-num_blocks // group) > cols * height:
        group *= 2
    return GridLayout(2, cols, 1, 0, group)


HOST_POOL_NAME = "host pool (swap)"      # swapped-out KV lives in host memory, whatever the device


def pool_name(device: str) -> str:
    """The KV pool's name for the device it lives on: a laptop's pool is in CPU memory, so "GPU" would tell a
    class that their laptop has a GPU (vLLM's names speak of GPU blocks because it runs on one)."""
    return "GPU KV blocks" if device.startswith("cuda") else f"KV blocks ({device.split(':')[0].upper()} memory)"


def gpu_cells(state: WatchState, group: int, selected: Optional[str]) -> list[Cell]:
    """Summarise the GPU pool into cells of ``group`` blocks."""
    view = state.view
    order = {rid: i for i, rid in enumerate(state.arrival_order)}
    cells = []
    n = len(view.block_owners)
    for start in range(0, n, group):
        blocks = range(start, min(start + group, n))
        owners = [view.block_owners[b] for b in blocks]
        used = sum(1 for o in owners if o)
        if used == 0:
            kind = "cached" if any(view.block_cached[b] for b in blocks) else "free"
            cells.append(Cell(kind, None, 0, 0, len(blocks), False, start))
            continue
        refs = max(len(o) for o in owners)
        is_selected = selected is not None and any(selected in o for o in owners)
        counts: dict[str, int] = {}
        for o in owners:
            for rid in o:
                counts[rid] = counts.get(rid, 0) + 1
        owner = selected if is_selected else min(counts, key=lambda r: (-counts[r], order.get(r, 1 << 30)))
        cells.append(Cell("shared" if refs > 1 else "used", owner, refs, used, len(blocks), is_selected, start))
    return cells


def cpu_cells(state: WatchState, group: int, selected: Optional[str]) -> list[Cell]:
    """Summarise the CPU swap pool: blocks hold swapped-out requests' KV."""
    owners = state.view.cpu_block_owner
    cells = []
    for start in range(0, len(owners), group):
        chunk = owners[start:start + group]
        held = [o for o in chunk if o is not None]
        if not held:
            cells.append(Cell("free", None, 0, 0, len(chunk), False, start))
            continue
        owner = selected if selected in held else max(set(held), key=held.count)
        cells.append(Cell("swapped", owner, 1, len(held), len(chunk), selected in held, start))
    return cells


def cell_look(cell: Cell, width: int, colour: str, dimmed: bool, line: int = 0) -> tuple[str, Style]:
    """Text and style of one line of a cell, ``width`` columns (the gap after the cell is not included).

    Line 0 carries the state (colour, "x3" for a shared block, a mark on the selected request's blocks);
    line 1, in tall cells, the block id; any further line (presenter cells) only the colour.
    """
    if cell.kind == "free":
        return ("·" if line == 0 else "").center(width), Style(color=FREE)
    if cell.kind == "cached":
        return "░" * width, Style(color=CACHED)
    if dimmed:
        colour = Color.parse(colour).blend(DIM_TOWARDS, 0.65).hex
    text_colour = "#9a9a9a" if dimmed else "#ffffff"
    if cell.used < cell.size:                         # a group cell partly in use
        level = max(1, min(len(PARTIAL) - 1, round(cell.used / cell.size * (len(PARTIAL) - 1))))
        return PARTIAL[level] * width, Style(color=colour, bold=cell.selected)
    if line >= 2:
        return " " * width, Style(bgcolor=colour)
    if line == 1:
        label = f"#{cell.first}" if cell.size == 1 else ""
        return label[-width:].center(width), Style(color=text_colour, bgcolor=colour, dim=True)
    if cell.kind == "shared" and cell.size > 1:      # no room for a count: a mark that sharing is going on
        return "+".center(width), Style(color=text_colour, bgcolor=colour, bold=True)
    if cell.kind == "shared":
        label = f"x{cell.ref_count}" if len(f"x{cell.ref_count}") <= width else f"{min(cell.ref_count, 99)}"
        if cell.selected and width >= len(label) + 2:
            label = "■ " + label
        return label[-width:].center(width), Style(color=text_colour, bgcolor=colour, bold=True)
    if cell.selected:
        return "■".center(width), Style(color=text_colour, bgcolor=colour, bold=True)
    return " " * width, Style(bgcolor=colour)


def legend(full: bool = False) -> Text:
    """The key to the map, drawn with the very looks the map uses. ``full`` (the help screen) adds the looks
    of the CPU map and of cells that group several blocks (large pools)."""
    sample = PALETTE[0]
    items = [(Cell("used", "r", 1, 1, 1, False), "request's block"),
             (Cell("shared", "r", 2, 1, 1, False), "shared by 2"),
             (Cell("cached", None, 0, 0, 1, False), "free, cached prefix"),
             (Cell("free", None, 0, 0, 1, False), "free"),
             (Cell("used", "r", 1, 1, 1, True), "selected request")]
    if full:
        items += [(Cell("swapped", "r", 1, 1, 1, False), "(host map) a swapped-out request's block"),
                  (Cell("used", "r", 1, 2, 4, False), "group of blocks, half in use"),
                  (Cell("shared", "r", 2, 4, 4, False), "group with shared blocks")]
    text = Text()
    for cell, label in items:
        glyph, style = cell_look(cell, 2, sample, False)
        text.append(glyph, style)
        text.append(f" {label}" + ("\n" if full else "  "))
    return text


class BlockMap(Widget):
    """One block pool (``pool="gpu"`` or ``"cpu"``) drawn as a grid of cells."""

    class RequestClicked(Message):
        """A cell was clicked: select the request that owns it."""

        def __init__(self, request_id: str) -> None:
            self.request_id = request_id
            super().__init__()

    def __init__(self, pool: str = "gpu", *, id: Optional[str] = None, classes: Optional[str] = None,
                 presenter: bool = False) -> None:
        super().__init__(id=id, classes=classes)
        self.pool = pool
        self.presenter = presenter            # bigger cells, for a projector (watch --presenter)
        self.state: Optional[WatchState] = None
        self.selected: Optional[str] = None
        self.placeholder = "waiting for the engine ..."
        self.cells: list[Cell] = []
        self.grid = GridLayout(3, 1, 1, 0, 1)

    # -------------------------------------------------------------- data in
    def show(self, state: Optional[WatchState], selected: Optional[str]) -> None:
        self.state, self.selected = state, selected
        self._relayout()
        self.refresh()

    def on_resize(self) -> None:
        self._relayout()

    @property
    def num_blocks(self) -> int:
        if self.state is None:
            return 0
        return self.state.info.num_blocks if self.pool == "gpu" else self.state.info.num_cpu_blocks

    def _relayout(self) -> None:
        if self.state is None:
            self.cells = []
            return
        size = self.content_size
        self.grid = choose_layout(self.num_blocks, size.width, size.height,
                                  PRESENTER_LOOKS if self.presenter else LOOKS)
        build = gpu_cells if self.pool == "gpu" else cpu_cells
        self.cells = build(self.state, self.grid.group, self.selected)
        what = pool_name(self.state.info.device) if self.pool == "gpu" else HOST_POOL_NAME
        group = self.grid.group
        scale = "1 cell = 1 block" if group == 1 else f"1 cell = {group} blocks"
        used = sum(c.used for c in self.cells)
        self.border_title = f"{what}: {used}/{self.num_blocks} in use"
        self.border_subtitle = f"{scale} of {self.state.info.block_size} tokens"

    # -------------------------------------------------------------- drawing
    def render_line(self, y: int) -> Strip:
        width = self.content_size.width
        if self.state is None:
            return Strip([Segment(self.placeholder[:width] if y == 0 else "")]) if width else Strip.blank(0)
        grid = self.grid
        line = y % grid.pitch
        if line >= grid.cell_height:
            return Strip.blank(width)
        row = self.cells[y // grid.pitch * grid.cols:(y // grid.pitch + 1) * grid.cols]
        # Dim the others only while the selected request holds blocks: there is something to pick out.
        selected = self.state.view.requests.get(self.selected) if self.selected is not None else None
        dim = selected is not None and bool(selected.blocks or selected.cpu_blocks)
        segments = []
        for cell in row:
            colour = self.state.colour(cell.owner) if cell.owner else FREE
            text, style = cell_look(cell, grid.cell_width - 1, colour, dim and not cell.selected, line)
            segments += [Segment(text, style), Segment(" ")]
        return Strip(segments).adjust_cell_length(width, Style()) if segments else Strip.blank(width)

    def on_click(self, event: events.Click) -> None:
        if self.state is None or not self.cells:
            return
        offset = event.get_content_offset(self)
        if offset is None:
            return
        index = self.grid.cell_at(offset.x, offset.y)
        if index is not None and index < len(self.cells) and self.cells[index].owner:
            self.post_message(self.RequestClicked(self.cells[index].owner))
