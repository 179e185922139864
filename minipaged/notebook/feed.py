"""What stands between a source of StepEvents (an engine, a server's stream, a trace) and the widget's views.

The engine's callback only appends the event to a list (``push``: no serialising on the engine's thread). A
flusher thread sends what came, at most ``max_rate_hz`` messages a second, each one JSON array of the steps since
the last (``{"kind": "steps"}``): a run of a thousand steps a second costs the kernel's comm channel ten
messages a second, not a thousand. A burst longer than ``max_steps_per_message`` is coalesced: the feed folds it
into its own EngineView and sends the state it left as one snapshot StepEvent (``{"kind": "snapshot"}``, the
same snapshot a late watcher of ``minipaged serve`` gets first), so the block map and the table stay exact and
the channel stays bounded. Each steps message says the step its batch follows (``after``): a view whose fold is
elsewhere (opened while the kernel was busy, so it missed steps) ignores batches until the answer to its
``hello``, a reset and a snapshot of the state then, puts it right; a view in step ignores that answer.

Pure Python over ``send(dict)``: no anywidget, no torch; tests/test_notebook.py drives it with a fake clock.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, Optional

from minipaged.event_view import EngineView, snapshot_event
from minipaged.events import EngineInfo, StepEvent

Send = Callable[[dict[str, Any]], None]
MAX_RATE_HZ = 10.0               # messages a second to the views, at most
MAX_STEPS_PER_MESSAGE = 100      # more steps than this since the last message: one snapshot instead
REPLAY_CHUNK = 400               # a recorded run reaches a view in messages of this many steps


def info_dict(info: EngineInfo) -> dict[str, Any]:
    return {"type": "engine", **asdict(info)}


class EventFeed:
    """Rate-bounded, coalescing sender of one engine's StepEvents to the widget's views."""

    def __init__(self, send: Send, info: Optional[EngineInfo] = None, *, max_rate_hz: float = MAX_RATE_HZ,
                 max_steps_per_message: int = MAX_STEPS_PER_MESSAGE,
                 clock: Callable[[], float] = time.monotonic,
                 on_info: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
        self.send = send
        self.on_info = on_info                # the widget's ``info`` trait: a view that opens draws at once
        self.interval_s = 1.0 / max_rate_hz
        self.max_steps = max_steps_per_message
        self.clock = clock
        self.info = info
        self.view = EngineView(info) if info is not None else None
        self.status = "idle"
        self._pending: list[StepEvent] = []
        self._append = self._pending.append
        self._lock = threading.RLock()
        self._last_send = -float("inf")
        # What was sent, for tests and for the widget's own counters.
        self.messages = 0
        self.steps_sent = 0
        self.steps_coalesced = 0
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------------------------ in (any thread)

    def push(self, event: StepEvent) -> None:
        """The engine's subscriber: O(1) on the engine's thread (list.append holds the GIL: no lock needed)."""
        self._append(event)

    def reset(self, info: EngineInfo, status: str = "live") -> None:
        """A new engine (a server restarted, another run): every view starts over."""
        with self._lock:
            self._pending.clear()
            self.info, self.view, self.status = info, EngineView(info), status
            if self.on_info is not None:
                self.on_info(info_dict(info))
            self._emit({"kind": "reset", "info": info_dict(info), "status": status})

    def set_status(self, text: str) -> None:
        with self._lock:
            self.status = text
            self._emit({"kind": "status", "text": text})

    # ------------------------------------------------------------------------------------ out

    def due(self) -> bool:
        return self.clock() - self._last_send >= self.interval_s

    def flush(self, force: bool = False) -> int:
        """Send what came since the last message, if the rate allows (or ``force``); returns the steps sent."""
        with self._lock:
            if not self._pending or self.view is None or not (force or self.due()):
                return 0
            batch = self._pending[:]
            del self._pending[:len(batch)]       # the engine may append meanwhile: keep what came after
            after = self.view.step               # a view whose fold is not at this step waits for a snapshot
            for ev in batch:
                self.view.apply(ev)
                for f in ev.finished:          # as the server's view does: a late view is told the live ones
                    self.view.requests.pop(f.request_id, None)
            if len(batch) > self.max_steps:
                self.steps_coalesced += len(batch)
                self._emit({"kind": "snapshot", "json": snapshot_event(self.view).to_json(), "skipped": len(batch)})
            else:
                self._emit({"kind": "steps", "after": after,
                            "json": "[" + ",".join(ev.to_json() for ev in batch) + "]"})
            self.steps_sent += len(batch)
            return len(batch)

    def hello(self, view_id: Any = None) -> None:
        """A view opened (or re-rendered): a reset for it alone, then the state now as one snapshot."""
        with self._lock:
            self.flush(force=True)
            if self.info is None:
                return
            self._emit({"kind": "reset", "info": info_dict(self.info), "status": self.status, "for": view_id})
            if self.view is not None and self.view.step:
                self._emit({"kind": "snapshot", "json": snapshot_event(self.view).to_json(), "skipped": 0,
                            "for": view_id})

    def _emit(self, msg: dict[str, Any]) -> None:
        self._last_send = self.clock()
        self.messages += 1
        self.send(msg)

    # ------------------------------------------------------------------------------------ the flusher

    def start(self) -> None:
        """A daemon thread that flushes at the rate bound (so steps reach the view while a cell still runs,
        and the last ones when the run ends)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="minipaged-notebook-feed", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except Exception:                     # a closed comm: nothing to draw into any more
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2)
        self.flush(force=True)


class ReplayFeed:
    """A recorded run (``minipaged watch --record FILE``): each view gets it all, in chunks, and keeps it all."""

    def __init__(self, send: Send, info: EngineInfo, steps_json: list[str]) -> None:
        self.send = send
        self.info = info
        self.steps_json = steps_json
        self.messages = 0

    @classmethod
    def from_file(cls, send: Send, path: str) -> "ReplayFeed":
        from minipaged.trace import read_trace

        info, _events = read_trace(path)            # checks the file, naming a bad line
        lines = [line.strip() for line in open(path, encoding="utf-8")]
        steps = [line for line in lines if line and json.loads(line).get("type") == "step"]
        return cls(send, info, steps)

    def hello(self, view_id: Any = None) -> None:
        self._emit({"kind": "reset", "info": info_dict(self.info), "status": "replay", "for": view_id,
                    "keep": max(1, len(self.steps_json)), "replay": True})
        for i in range(0, len(self.steps_json), REPLAY_CHUNK):
            self._emit({"kind": "steps", "json": "[" + ",".join(self.steps_json[i:i + REPLAY_CHUNK]) + "]",
                        "for": view_id})

    def _emit(self, msg: dict[str, Any]) -> None:
        self.messages += 1
        self.send(msg)

    def stop(self) -> None:
        pass
