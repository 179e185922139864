"""The ``?`` screen: every key, and how to read the block map."""
from __future__ import annotations

from typing import Iterable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from .widgets.block_map import legend

KEY_NAMES = {"space": "space", "question_mark": "?", "plus": "+", "equals_sign": "=", "minus": "-",
             "underscore": "_", "left": "←", "right": "→", "up": "↑", "down": "↓"}

READING = (
    "Each cell of the map is one KV block: the keys and values of block_size tokens. A request's blocks "
    "can sit anywhere in the pool (paged attention reads them through its block table). A number like x3 "
    "means three requests share the block: their prompts start the same way, so the prefix cache served it "
    "once for all. Grey blocks are free but still hold a cached prefix, reused if a later prompt matches, "
    "evicted oldest-first when the pool needs room. When the pool runs dry the newest running request is "
    "preempted: recompute drops its blocks, swap copies them to the host pool (the second map).")


def key_label(keys: str) -> str:
    return " ".join(KEY_NAMES.get(k, k) for k in keys.split(","))


class HelpScreen(ModalScreen[None]):
    """Lists the app's bindings (from the app itself, so it cannot drift) and the map's legend."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]

    def __init__(self, bindings: Iterable[Binding], *, replay: bool) -> None:
        super().__init__()
        self._key_list = list(bindings)
        self._replay = replay

    def compose(self) -> ComposeResult:
        keys_by_action: dict[str, list[str]] = {}
        for b in self._key_list:
            keys_by_action.setdefault(b.description, []).append(b.key_display or key_label(b.key))
        rows = [(" ".join(keys), description) for description, keys in keys_by_action.items()]
        rows.append(("click", "select the request that owns a block or a table row"))
        table = Text()
        for keys, description in rows:
            table.append(f"  {keys:<12} ", style="bold #edc948")
            table.append(f"{description}\n")
        with VerticalScroll(id="help-box"):
            yield Static(Text("minipaged watch: keys", style="bold"))
            yield Static(table)
            yield Static(Text("\nReading the block map", style="bold"))
            yield Static(legend(full=True))
            yield Static(Text(READING))
            yield Static(Text("\nb / ← step back through " + ("the trace" if self._replay else "the run so far")
                              + "; → / n step forward one step.  Esc, ? or q closes this help.", style="dim"))
