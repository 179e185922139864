"""minipaged in a notebook: the web page's live engine view as a Jupyter widget (JupyterLab, Notebook 7, VS Code,
Colab), from one anywidget ES module.

    from minipaged.notebook import watch, replay, attach
    w = watch(engine)          # then, in the next cell: engine.generate(...), or engine.step() by hand
    replay("run.jsonl")        # a recorded run (minipaged watch --record FILE), with a slider
    attach("http://HOST:8000") # a live `minipaged serve`, from its /v1/events stream (no torch needed)
    stop = record(engine, "run.jsonl")   # a trace to share: replay() draws it in any notebook

Install with ``pip install "minipaged[notebook]"`` (anywidget; nothing heavy). Nothing in this package imports
torch or transformers: ``attach`` and ``replay`` are thin clients (a test keeps it so).
"""
from __future__ import annotations

from typing import Any

from .record import record

__all__ = ["watch", "replay", "attach", "record", "EngineWidget"]


def __getattr__(name: str) -> Any:
    # anywidget is imported only when a widget is asked for, so the feed (feed.py) is usable and testable without it
    if name in ("watch", "replay", "attach", "EngineWidget"):
        from . import widget
        return getattr(widget, name)
    raise AttributeError(name)
