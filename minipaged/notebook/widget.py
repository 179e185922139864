"""The widget itself (anywidget) and its three ways in: ``watch(engine)``, ``replay(path)``, ``attach(url)``.

Nothing here imports torch or transformers: ``watch`` takes an engine someone else built and only calls its
``info`` and ``subscribe``; ``attach`` reads a server's ``/v1/events`` stream over HTTP in a thread (httpx).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Optional

import anywidget
import traitlets

from minipaged.events import EngineInfo, StepEvent

from .bundle import widget_css, widget_esm
from .feed import MAX_RATE_HZ, MAX_STEPS_PER_MESSAGE, EventFeed, ReplayFeed, info_dict

KEEP = 500                        # steps each view keeps for its slider (older ones fold into its base state)


class EngineWidget(anywidget.AnyWidget):
    """The web page's block map, batch bar and budget, gauges, queues and request table, in a notebook cell.

    ``source`` feeds it (an EventFeed for a live engine or server, a ReplayFeed for a trace); ``stop()`` ends a
    live feed (the engine keeps running, unwatched). ``step`` is the newest step sent to the views."""

    _esm = widget_esm()
    page_css = traitlets.Unicode(widget_css()).tag(sync=True)
    keep = traitlets.Int(KEEP).tag(sync=True)
    # The engine's header: a view draws its empty map at once and folds the steps that follow, even while the
    # kernel is busy running the cell below (its hello is answered only when that cell ends).
    info = traitlets.Dict(allow_none=True, default_value=None).tag(sync=True)

    def __init__(self, keep: int = KEEP, **kwargs: Any) -> None:
        super().__init__(keep=keep, **kwargs)
        self.source: Any = None
        self._stoppers: list[Any] = []
        self.on_msg(self._on_msg)

    def _on_msg(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if isinstance(content, dict) and content.get("kind") == "hello" and self.source is not None:
            self.source.hello(content.get("id"))

    @property
    def step(self) -> int:
        view = getattr(self.source, "view", None)
        if view is None:
            return len(getattr(self.source, "steps_json", []))
        return view.step

    def flush(self) -> None:
        """Send what is pending now (the flusher thread does this at most ``max_rate_hz`` times a second)."""
        if isinstance(self.source, EventFeed):
            self.source.flush(force=True)

    def stop(self) -> None:
        for stop in self._stoppers:
            stop()
        self._stoppers.clear()
        if self.source is not None:
            self.source.stop()

    def close(self) -> None:
        self.stop()
        super().close()


def watch(engine: Any, *, keep: int = KEEP, max_rate_hz: float = MAX_RATE_HZ,
          max_steps_per_message: int = MAX_STEPS_PER_MESSAGE) -> EngineWidget:
    """A live view of ``engine`` (a ``minipaged.Engine``): display it, then run ``engine.generate(...)`` or
    ``engine.step()`` in the cells below; the view follows every step."""
    widget = EngineWidget(keep=keep)
    feed = EventFeed(widget.send, engine.info, max_rate_hz=max_rate_hz, max_steps_per_message=max_steps_per_message)
    feed.status = "live"
    widget.info = info_dict(engine.info)
    widget.source = feed
    widget._stoppers.append(engine.subscribe(feed.push))
    feed.start()
    return widget


def replay(path: str, *, keep: Optional[int] = None) -> EngineWidget:
    """A recorded run (a ``.jsonl`` trace from ``minipaged watch --record FILE`` or ``record(engine, path)``),
    every step kept, with a slider and a play button."""
    widget = EngineWidget(keep=keep or KEEP)
    widget.source = ReplayFeed.from_file(widget.send, path)
    return widget


def attach(url: str, *, api_key: Optional[str] = None, keep: int = KEEP, max_rate_hz: float = MAX_RATE_HZ,
           max_steps_per_message: int = MAX_STEPS_PER_MESSAGE) -> EngineWidget:
    """A live ``minipaged serve`` at ``url`` (``http://HOST:8000``), drawn from its ``/v1/events`` stream, read
    in a background thread (reconnecting when the server comes back). No torch in this process."""
    widget = EngineWidget(keep=keep)
    feed = EventFeed(widget.send, None, max_rate_hz=max_rate_hz, max_steps_per_message=max_steps_per_message,
                     on_info=lambda info: setattr(widget, "info", info))
    widget.source = feed
    stop = threading.Event()
    reader = threading.Thread(target=read_stream, args=(url, feed, stop, api_key), name="minipaged-attach",
                              daemon=True)
    widget._stoppers.append(stop.set)
    reader.start()
    feed.start()
    return widget


def read_stream(url: str, feed: EventFeed, stop: threading.Event, api_key: Optional[str] = None,
                retry_s: float = 2.0) -> None:
    """Read ``url``'s event stream into ``feed`` until ``stop`` is set: an engine header resets the views, every
    step record is pushed; a lost server is said in the status line and tried again every ``retry_s``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    endpoint = url.rstrip("/") + "/v1/events"
    while not stop.is_set():
        try:
            with httpx.stream("GET", endpoint, headers=headers, timeout=httpx.Timeout(10.0, read=30.0)) as response:
                if response.status_code != 200:
                    feed.set_status(f"error: {endpoint} answered {response.status_code}")
                    stop.wait(retry_s * 5)
                    continue
                name, data = "message", []
                for line in response.iter_lines():
                    if stop.is_set():
                        return
                    if line.startswith(":"):
                        continue                                   # the server's heartbeat
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
                    elif not line:
                        if data and name == "message":
                            record = json.loads("\n".join(data))
                            if record.get("type") == "engine":
                                feed.reset(EngineInfo.from_dict(record), status=f"live: {url}")
                            elif record.get("type") == "step":
                                feed.push(StepEvent.from_dict(record))
                        elif name == "goodbye":
                            feed.set_status("the server stopped")
                        name, data = "message", []
            feed.set_status("lost the server; reconnecting")
        except (httpx.HTTPError, ValueError) as exc:
            feed.set_status(f"lost the server ({type(exc).__name__}); reconnecting")
        stop.wait(retry_s)
