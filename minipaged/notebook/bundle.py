"""The widget's ES module and stylesheet, put together at import time from the web page's own files.

The notebook widget draws with the page's modules (``minipaged/web/static``): fold.mjs (the one JavaScript fold of
StepEvents, checked against Python's by tests/test_web_fold.py), mapwindow.mjs, busy.mjs, spec.mjs and draw.mjs
(the block map, batch bar, gauges, queues, request table, log and legend), then this package's widget.mjs, which
only lays them out in a shadow root and folds what the kernel sends. The modules are joined the way
``minipaged.web.inline_script`` joins them for a self-contained page (imports between them removed, ``export``
dropped), and ``render`` is exported for anywidget. No copy of the fold lives here.
"""
from __future__ import annotations

from functools import lru_cache
from importlib import resources
from pathlib import Path

from minipaged.web import _EXPORT, _IMPORT

# The page's modules the widget draws with, in dependency order (sse.mjs and app.mjs are the page's own glue).
PAGE_MODULES = ("fold.mjs", "mapwindow.mjs", "busy.mjs", "spec.mjs", "draw.mjs")


def _static() -> Path:
    return Path(str(resources.files("minipaged.web") / "static"))


def _here() -> Path:
    return Path(str(resources.files(__package__)))


@lru_cache(maxsize=1)
def widget_esm() -> str:
    """One ES module: the page's modules, then widget.mjs; it exports ``render`` (anywidget's entry point)."""
    parts = []
    for name in PAGE_MODULES:
        code = (_static() / name).read_text(encoding="utf-8")
        parts.append(f"// ---- minipaged/web/static/{name}\n" + _EXPORT.sub("", _IMPORT.sub("", code)))
    parts.append("// ---- minipaged/notebook/widget.mjs\n" + (_here() / "widget.mjs").read_text(encoding="utf-8"))
    parts.append("export default { render };\n")
    return "\n".join(parts)


@lru_cache(maxsize=1)
def widget_css() -> str:
    """The page's stylesheet for the widget's shadow root: its ``:root`` is the shadow host, its ``body`` the
    widget's outer box (nothing in it can reach the notebook's own page)."""
    css = (_static() / "style.css").read_text(encoding="utf-8")
    return css.replace(":root {", ":host {").replace("body.projector", ".mp-body.projector").replace(
        "body {", ".mp-body {")
