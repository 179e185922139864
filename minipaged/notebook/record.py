"""``record(engine, "run.jsonl")``: write a run's trace from a notebook, the file ``minipaged watch --record`` writes,
which ``replay`` draws in any notebook, ``minipaged watch --replay`` in a terminal and ``minipaged export-html``
turns into one page. No anywidget needed."""
from __future__ import annotations

from typing import Any, Callable

from minipaged.trace import write_trace_event, write_trace_header


def record(engine: Any, path: str) -> Callable[[], None]:
    """Record every step of ``engine`` from now into ``path`` (a JSON-lines trace); returns ``stop()``, which
    stops recording and closes the file."""
    fp = open(path, "w", encoding="utf-8")
    write_trace_header(fp, engine.info)
    unsubscribe = engine.subscribe(lambda event: write_trace_event(fp, event))

    def stop() -> None:
        unsubscribe()
        if not fp.closed:
            fp.close()
    return stop
