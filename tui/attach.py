"""``minipaged watch --attach URL``: the same TUI, drawing a live ``minipaged serve`` from its event stream.

``AttachRun`` stands where ``LiveRun`` stands for a local engine (``load`` / ``step`` / ``close``), but its
StepEvents come from the server's ``GET /v1/events``: an engine header, a snapshot of the current state
(so a client that joins late draws the right block map), then every step. A background thread reads the
stream as it comes, so a paused screen never makes the server wait. ``AttachApp`` adds a prompt box: what
you type goes to the server's OpenAI endpoint like any client's request, and joins the batch beside
everyone else's.

A dead server must not look like a finished run. The server sends a ``: heartbeat`` comment when it has
nothing else to say and ``event: goodbye`` when it shuts down on purpose; silence longer than
``silence_timeout_s`` or a stream that ends without the goodbye means the server was lost. The client then
tries once to reconnect (a fresh header and snapshot: ``step`` returns the new ``EngineInfo`` first, and
the caller starts its picture over; a server that dropped a slow watcher is back this way) and, if that
fails or the new stream breaks before its first step, raises ``ServerLost`` ("lost the server at step N"),
which ``watch --attach`` reports with a non-zero exit. Comment lines and unknown event names are ignored.

Nothing here imports torch or transformers (a test keeps it so): a thin client starts in about a second.
"""
from __future__ import annotations

import json
import queue
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator, Optional, Union

import httpx
from textual.binding import Binding
from textual.widgets import Footer, Input

from minipaged.events import EngineInfo, StepEvent

from .app import WatchApp

Progress = Callable[[str], None]
DEFAULT_PROMPT_MAX_TOKENS = 64
SILENCE_TIMEOUT_S = 15.0         # three of the server's default heartbeats (5 s) missed: it is gone or frozen
_GOODBYE = object()              # the server said goodbye: a normal end


class ServerLost(ConnectionError):
    """The event stream ended without the server's goodbye, or went silent, and one reconnect failed."""


@dataclass(frozen=True)
class _Lost:
    why: str


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its name ("message" unless the server named it) and its data."""

    name: str
    data: str


def sse_events(lines: Iterator[str]) -> Iterator[SseEvent]:
    """Server-sent events from the stream's lines; comments (``: heartbeat``) are skipped."""
    name, data = "message", []
    for line in lines:
        if not line:                                      # a blank line ends an event
            if data:
                yield SseEvent(name, "\n".join(data))
            name, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            name = line[len("event:"):].strip()
        elif line.startswith("data:"):
            data.append(line[len("data:"):].removeprefix(" "))
    if data:
        yield SseEvent(name, "\n".join(data))


def parse_record(payload: str) -> Union[EngineInfo, StepEvent]:
    """One record of the event stream (the same JSON as a trace line)."""
    record = json.loads(payload)
    if record.get("type") == "engine":
        return EngineInfo.from_dict(record)
    if record.get("type") == "step":
        return StepEvent.from_dict(record)
    raise ValueError(f"unknown record type {record.get('type')!r}")


class AttachRun:
    """StepEvents from a live server's ``/v1/events``."""

    def __init__(self, url: str, api_key: Optional[str] = None, silence_timeout_s: float = SILENCE_TIMEOUT_S) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.silence_timeout_s = silence_timeout_s
        self.info: Optional[EngineInfo] = None
        self.last_step = 0                    # the last step seen, for "lost the server at step N"
        self.goodbye: Optional[str] = None    # the server's reason, once it said goodbye
        self.lost: Optional[str] = None       # why, once the server was lost (and reconnecting failed)
        self._events: "queue.Queue[Any]" = queue.Queue()
        self._closed = threading.Event()
        self._client: Optional[httpx.Client] = None

    def load(self, progress: Progress = lambda message: None) -> EngineInfo:
        """Connect and read the engine header; raises ConnectionError saying what to check."""
        progress(f"connecting to {self.url}")
        self._client = httpx.Client(timeout=httpx.Timeout(10.0, read=self.silence_timeout_s), headers=self.headers)
        header, events, response = self._connect()
        self.info = header
        threading.Thread(target=self._read, args=(events, response), name="minipaged-attach", daemon=True).start()
        return header

    def _connect(self) -> tuple[EngineInfo, Iterator[SseEvent], httpx.Response]:
        assert self._client is not None
        try:
            response = self._client.send(self._client.build_request("GET", self.url + "/v1/events"), stream=True)
        except httpx.HTTPError as exc:
            raise ConnectionError(f"cannot reach a minipaged server at {self.url} ({exc}); start one with "
                                  f"`minipaged serve` and pass its address, e.g. http://127.0.0.1:8000.") from None
        if response.status_code != 200:
            raise ConnectionError(f"{self.url}/v1/events answered {response.status_code}: {response.read()[:200]!r}"
                                  + (" (pass the server's key with --api-key)" if response.status_code == 401 else ""))
        events = (e for e in sse_events(response.iter_lines()) if e.name == "message" or e.name == "goodbye")
        try:
            header = parse_record(next(events).data)
        except (StopIteration, httpx.HTTPError, ValueError) as exc:
            response.close()
            raise ConnectionError(f"{self.url}/v1/events did not start with the engine header ({exc!r})") from None
        if not isinstance(header, EngineInfo):
            response.close()
            raise ConnectionError(f"{self.url}/v1/events did not start with the engine header")
        return header, events, response

    def _read(self, events: Iterator[SseEvent], response: httpx.Response) -> None:
        """The reader thread: records into the queue; at the end, a goodbye, a reconnect, or the loss."""
        reconnected = False
        while True:
            why, num_records = self._read_stream(events, response)
            if why is None or self._closed.is_set():
                self._events.put(_GOODBYE)
                return
            if reconnected and num_records <= 1:          # a reconnect that broke before its first step:
                self._events.put(_Lost(why))              # give up rather than loop
                return
            try:                                          # one try per loss: a fresh header and snapshot
                header, events, response = self._connect()
            except ConnectionError as exc:
                self._events.put(_Lost(f"{why}; reconnecting failed: {exc}"))
                return
            self._events.put(header)                      # the caller starts over from the snapshot
            reconnected = True

    def _read_stream(self, events: Iterator[SseEvent], response: httpx.Response) -> tuple[Optional[str], int]:
        """Read one connection to its end: (None after the server's goodbye, else why it was lost; how many
        records it brought after the header)."""
        num_records = 0
        try:
            for event in events:
                if event.name == "goodbye":
                    self.goodbye = json.loads(event.data).get("reason", "") if event.data else ""
                    return None, num_records
                self._events.put(parse_record(event.data))
                num_records += 1
            return "the event stream ended without the server's goodbye", num_records
        except httpx.ReadTimeout:
            return f"the server sent nothing (not even a heartbeat) for {self.silence_timeout_s:g} s", num_records
        except (httpx.HTTPError, ValueError) as exc:
            return f"the event stream broke ({exc.__class__.__name__})", num_records
        finally:
            response.close()

    def step(self) -> Union[StepEvent, EngineInfo, None]:
        """The next event, waiting for the server to make one; None once the server said goodbye (or the
        client is closing). After a reconnect, the new ``EngineInfo`` comes first: start the picture over.
        Raises ServerLost if the server went away."""
        while not self._closed.is_set():
            try:
                item = self._events.get(timeout=0.2)
            except queue.Empty:
                continue
            if item is _GOODBYE:
                return None
            if isinstance(item, _Lost):
                self.lost = item.why
                raise ServerLost(f"lost the server at step {self.last_step}: {item.why.rstrip('.')}.")
            if isinstance(item, StepEvent):
                self.last_step = item.step
            return item
        return None

    def interrupt(self) -> None:
        """Wake a ``step`` that waits for the server (the app is quitting)."""
        self._closed.set()

    def close(self) -> None:
        self._closed.set()
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ sending prompts
    def model_name(self) -> str:
        response = httpx.get(self.url + "/v1/models", headers=self.headers, timeout=10)
        response.raise_for_status()
        return response.json()["data"][0]["id"]

    def send_prompt(self, prompt: str, max_tokens: int, on_id: Callable[[str], None]) -> tuple[str, str]:
        """Send a chat request through the OpenAI endpoint, streamed; ``on_id`` hears its id as soon as the
        server has queued it. Returns (id, text)."""
        body = {"model": self.model_name(), "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "stream": True}
        request_id, text = "", []
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, headers=self.headers,
                          timeout=httpx.Timeout(10.0, read=None)) as response:
            if response.status_code != 200:
                raise ValueError(json.loads(response.read())["error"]["message"])
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if not request_id:
                    request_id = chunk["id"]
                    on_id(request_id)
                text.extend(c["delta"].get("content") or "" for c in chunk["choices"])
        return request_id, "".join(text)


class AttachApp(WatchApp):
    """The watch TUI on a live server, with a prompt box (``/`` focuses it, escape leaves it).

    The box does not take the focus at start (``AUTO_FOCUS``): with it focused, ``q`` and the other keys were
    letters in the box, and a class trial could not quit. It sits above the key bar, not docked over it."""

    TITLE = "minipaged watch --attach"
    AUTO_FOCUS = None
    BINDINGS = WatchApp.BINDINGS + [Binding("slash", "focus_prompt", "Prompt", key_display="/"),
                                    Binding("escape", "leave_prompt", "Leave prompt", show=False)]

    def __init__(self, attach: AttachRun, *, max_tokens: int = DEFAULT_PROMPT_MAX_TOKENS, **kwargs: Any) -> None:
        kwargs.setdefault("speed", 0.0)         # keep up with the server: it does not wait for the screen
        super().__init__(live=attach, description=f"attached to {attach.url}", **kwargs)
        self.attach = attach
        self.max_tokens = max_tokens
        self.answers: list[tuple[str, str]] = []      # (request id, text) of the prompts sent from the box

    def compose(self):
        for widget in super().compose():
            if isinstance(widget, Footer):
                yield Input(placeholder="/ to type a prompt, enter sends it (it joins the batch beside everyone "
                                        "else's), escape leaves the box", id="prompt")
            yield widget

    def _engine_stepped(self, event: Union[StepEvent, EngineInfo, None]) -> None:
        if isinstance(event, EngineInfo):       # reconnected: start the picture over from the fresh snapshot
            self.events.clear()
            self.position = 0
            self.engine_busy = False
            self._engine_ready(event)
            self.notify("reconnected to the server: the picture starts again from its snapshot", timeout=10)
            self._advance()
            return
        super()._engine_stepped(event)

    def mode_label(self) -> tuple[str, str]:
        """The header's first word: LIVE only while the stream is alive; a lost server must not look live."""
        if self.attach.lost is not None:
            return "SERVER GONE", "bold reverse red"
        if self.attach.goodbye is not None or (self.engine_done and self.live is not None):
            return "SERVER STOPPED", "bold #edc948"
        if self.engine_error and self.info is None:
            return "NOT CONNECTED", "bold reverse red"
        return super().mode_label()

    def busy_text(self, waited_s: float) -> str:
        """The server steps on its own schedule: waiting for its next event is usually an idle server, not a
        step in flight, so say only what is known (and nothing for the first moments)."""
        return "" if waited_s < 2 else f"  waiting for the server's next step ({waited_s:.0f} s)"

    def action_focus_prompt(self) -> None:
        self.query_one("#prompt", Input).focus()

    def action_leave_prompt(self) -> None:
        self.set_focus(None)

    def on_input_submitted(self, message: Input.Submitted) -> None:
        prompt = message.value.strip()
        message.input.clear()
        if prompt:
            self.run_worker(lambda: self._send(prompt), thread=True, group="prompts")

    def _send(self, prompt: str) -> None:
        """In a worker thread: send, select the request once queued, tell the answer when it is done."""
        try:
            request_id, text = self.attach.send_prompt(
                prompt, self.max_tokens, on_id=lambda rid: self._from_thread(self.select, rid))
        except (httpx.HTTPError, ValueError) as exc:
            self._from_thread(partial(self.notify, f"the server refused the prompt: {exc}", severity="error",
                                      timeout=10))
            return
        self._from_thread(self._answered, request_id, text)

    def _answered(self, request_id: str, text: str) -> None:
        self.answers.append((request_id, text))
        name = self.state.short_name(request_id) if self.state is not None else request_id
        self.notify(text[:300] or "(no text)", title=f"{name} finished", timeout=15)

    async def action_quit(self) -> None:
        self.attach.interrupt()
        await super().action_quit()

    def on_unmount(self) -> None:
        """However the app ends (q, an error in a panel, a test that leaves), the engine worker's ``step`` stops
        waiting for the server: otherwise the process waits on that thread until the server goes away."""
        self.attach.interrupt()


__all__ = ["AttachRun", "AttachApp", "ServerLost", "parse_record", "sse_events"]
