"""The browser live view: static files (``static/``) that every browser draws from the event stream.

``minipaged serve`` serves them at ``/`` (the page reads ``/v1/events``). ``self_contained_html`` makes one
file with the CSS, the JavaScript and a recorded trace inlined, which opens offline (``minipaged export-html``;
``minipaged watch --replay FILE --web`` serves that file). Nothing here imports torch: a replay is a thin client.
"""
from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Optional

MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
               ".mjs": "text/javascript; charset=utf-8"}
MODULES = ("sse.mjs", "fold.mjs", "mapwindow.mjs", "busy.mjs", "spec.mjs", "draw.mjs", "app.mjs")   # dependency order
_IMPORT = re.compile(r'^import\s[^;]*?from\s+"\./[\w.]+";\s*$', re.M)
_EXPORT = re.compile(r"^export\s+", re.M)


def _static() -> Path:
    return Path(str(resources.files(__package__) / "static"))


def index_html() -> str:
    return (_static() / "index.html").read_text(encoding="utf-8")


def fleet_html() -> str:
    """The fleet view (``minipaged fleet``): every replica's block map side by side."""
    return (_static() / "fleet.html").read_text(encoding="utf-8")


def static_file(name: str) -> Optional[tuple[bytes, str]]:
    """A file of the page by its bare name (no paths: nothing else on the disk can be asked for)."""
    if "/" in name or "\\" in name or name.startswith(".") or name.endswith(".html"):
        return None
    path = _static() / name
    media = MEDIA_TYPES.get(path.suffix)
    if media is None or not path.is_file():
        return None
    return path.read_bytes(), media


def inline_script() -> str:
    """The page's modules as one script: imports between them removed, ``export`` dropped."""
    parts = []
    for name in MODULES:
        code = (_static() / name).read_text(encoding="utf-8")
        parts.append(f"// ---- {name}\n" + _EXPORT.sub("", _IMPORT.sub("", code)))
    return "\n".join(parts)


def self_contained_html(trace_lines: list[str], title: str = "minipaged replay") -> str:
    """The page with its CSS, its JavaScript and ``trace_lines`` (a trace's JSON lines) inside: no other file,
    no network."""
    html = index_html()
    css = (_static() / "style.css").read_text(encoding="utf-8")
    trace = "\n".join(json_in_script(line.strip()) for line in trace_lines if line.strip())
    html = html.replace('<link rel="stylesheet" href="web/style.css">', f"<style>\n{css}</style>")
    html = html.replace("<title>minipaged: live engine</title>", f"<title>{_escape(title)}</title>")
    script = inline_script()
    assert "<!--" not in script and "<script" not in script.lower() and "</script" not in script.lower(), \
        "the page's code must not contain what would end or escape its inline script"
    html = html.replace('<script type="module" src="web/app.mjs"></script>',
                        f'<script type="application/json" id="trace">\n{trace}\n</script>\n'
                        f'<script type="module">\n{script}\n</script>')
    return html


def json_in_script(line: str) -> str:
    """A JSON line safe inside ``<script type="application/json">``: every "<" written as "\\u003c", which JSON
    reads back as "<". Escaping "</" alone was not enough: a prompt holding "<!--<script>" puts the HTML parser
    in its "double-escaped" state, where the next "</script>" no longer ends the block, and the page's own
    script was swallowed into the JSON (a blank page). With no "<" left, no tag can start or end in there."""
    return line.replace("<", "\\u003c")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def trace_html(trace_path: str) -> str:
    """A recorded trace (``watch --record``) as one self-contained page; raises ValueError if it is not a trace."""
    from minipaged.trace import read_trace

    info, events = read_trace(trace_path)               # checks it, with the line number of a bad line
    lines = Path(trace_path).read_text(encoding="utf-8").splitlines()
    return self_contained_html(lines, title=f"minipaged replay: {Path(trace_path).name} ({len(events)} steps, "
                                            f"{info.model})")
