"""Trace files: a recorded run, one JSON object a line.

First an ``EngineInfo`` header (``{"type": "engine", ...}``), then one ``StepEvent`` a line (``{"type": "step",
...}``, ``StepEvent.to_json``): the same records the server's event stream sends, so a trace replays in the
TUI, the web page and ``minipaged plot`` exactly as the live run drew.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from typing import IO, Optional

from .events import EngineInfo, StepEvent


def write_trace_header(fp: IO[str], info: EngineInfo) -> None:
    fp.write(json.dumps({"type": "engine", **asdict(info)}) + "\n")


def write_trace_event(fp: IO[str], event: StepEvent) -> None:
    fp.write(event.to_json() + "\n")


def read_trace(path: str) -> tuple[EngineInfo, list[StepEvent]]:
    """Load a JSON-lines trace; raises ValueError with the line number if the file is not a trace."""
    info: Optional[EngineInfo] = None
    events: list[StepEvent] = []
    with open(path, encoding="utf-8") as fp:
        for lineno, line in enumerate(fp, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                kind = record.get("type")
                if kind == "engine":
                    info = EngineInfo.from_dict(record)
                elif kind == "step":
                    events.append(StepEvent.from_dict(record))
                else:
                    raise ValueError(f"unknown record type {kind!r}")
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a minipaged trace line ({exc})") from exc
    if info is None:
        raise ValueError(f"{path}: no engine header; record traces with `minipaged watch --record FILE`.")
    return info, events
