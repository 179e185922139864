"""``WatchApp``: the Textual app behind ``minipaged watch``.

How it works, in three sentences. The screen shows a ``WatchState``: the fold of the StepEvents seen so
far (events 0..position-1). Moving forward applies the next event; moving back refolds from event 0; the
app keeps every event, so both work on a live run as well as on a replayed trace. Live, the engine sits in
a Textual thread worker that runs one ``engine.step()`` each time the UI asks for one and hands the event
back with ``call_from_thread``: the UI thread never waits on the model, so it stays responsive while
paused, while stepping and while the model loads.
"""
from __future__ import annotations

import queue
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Container, Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widget import Widget
from textual.widgets import Footer, Static
from textual.worker import get_current_worker

from minipaged.events import EngineInfo, StepEvent

from .driver import LiveRun
from .help import HelpScreen
from .state import WatchState
from .widgets.batch import BatchPanel
from .widgets.block_map import BlockMap, legend
from .widgets.event_log import EventLog
from .widgets.gauges import Gauges
from .widgets.output import OutputPanel
from .widgets.queues import RequestTable

LESSON_SIZE = (160, 45)        # columns x lines at which the lesson panel and the engine panels all fit
SPEEDS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 0.0)    # steps per second; 0 = as fast as possible
RATE_STEPS = 6                                          # steps the achieved rate is measured over
MAX_SPEED_BATCH = 8                                     # events applied per tick at full speed (replay)
REFRESH_INTERVAL = 1 / 20                               # redraw at most 20 times a second


def speed_label(speed: float) -> str:
    return "max speed" if speed == 0 else f"{speed:g} steps/s"


class WatchApp(App[int]):
    """Watch an engine work, step by step: live (``live=LiveRun``) or from a trace (``replay=(info, events)``)."""

    CSS_PATH = "watch.tcss"
    TITLE = "minipaged watch"
    ENABLE_COMMAND_PALETTE = False      # every action has its key; a palette would only distract in class
    BINDINGS = [
        Binding("space", "toggle_pause", "Pause/Run"),
        Binding("n", "step", "Step"),
        Binding("right", "step", "Step", show=False, priority=True),
        Binding("b", "back", "Back"),
        Binding("left", "back", "Back", show=False, priority=True),
        Binding("plus,equals_sign", "faster", "Faster", key_display="+"),
        Binding("minus,underscore", "slower", "Slower", key_display="-"),
        Binding("up", "select(-1)", "Select previous request", show=False),
        Binding("down", "select(1)", "Select next request", show=False),
        Binding("s", "screenshot", "Save a picture of the screen (SVG and PNG)", show=False),
        Binding("p", "plot", "Save a plot of the run so far: requests over steps, KV blocks, tokens (PNG)",
                show=False),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, *, live: Optional[LiveRun] = None,
                 replay: Optional[tuple[EngineInfo, list[StepEvent]]] = None, speed: float = 4.0,
                 paused: bool = False, description: str = "", lesson: Any = None,
                 presenter: bool = False) -> None:
        super().__init__()
        if (live is None) == (replay is None):
            raise ValueError("give exactly one of live= or replay=")
        self.live = live
        self.events: list[StepEvent] = list(replay[1]) if replay else []
        self.info: Optional[EngineInfo] = replay[0] if replay else None
        self.state: Optional[WatchState] = WatchState(self.info) if self.info else None
        self.position = 0                    # events applied to self.state
        self.selected: Optional[str] = None
        self.user_selected = False          # True once the user picks a request (see _keep_selection_valid)
        self.paused = paused
        self.speed = speed if speed in SPEEDS else min(SPEEDS[:-1], key=lambda s: abs(s - speed))
        self.description = description
        self.lesson = lesson                 # watch --lesson N: its text, checkpoints and quiz in the side panel
        self.presenter = presenter           # watch --presenter: map, batch and gauges only, bigger cells
        # Called as listener(event, state) after each event is shown (lessons check their checkpoints here).
        self.step_listeners: list[Callable[[StepEvent, WatchState], None]] = []
        self.rewind_listeners: list[Callable[[WatchState], None]] = []     # called after go_to (stepping back)
        self.status = "loading the model ..." if live else "replaying a recorded trace"
        self.engine_busy = False             # a step was asked of the worker and has not come back
        self._busy_since = 0.0               # when that step was asked for (the header shows how long it runs)
        self.queued_steps = 0                # n pressed while a step was running: each runs when it is back
        self._shown_at: deque[float] = deque(maxlen=RATE_STEPS)   # when recent steps reached the screen
        self.engine_done = replay is not None
        self.engine_error: Optional[str] = None
        self._commands: "queue.Queue[str]" = queue.Queue()
        self._engine_thread: Optional[threading.Thread] = None
        self._ticker: Any = None
        self._last_refresh = 0.0
        self._refresh_pending = False

    # ------------------------------------------------------------------ layout
    def compose(self) -> ComposeResult:
        yield Static(id="topbar")
        with Horizontal(id="body"):
            with Vertical(id="main"):
                with Horizontal(id="upper"):
                    with Vertical(id="maps"):
                        yield BlockMap("gpu", id="gpu-map", presenter=self.presenter)
                        yield BlockMap("cpu", id="cpu-map", presenter=self.presenter)
                        yield Static(legend(), id="legend")
                    with Vertical(id="stats"):
                        yield BatchPanel(id="batch")
                        yield Gauges(id="gauges")
                with Horizontal(id="lower"):
                    yield RequestTable(id="requests")
                    with Vertical(id="right-lower"):
                        yield EventLog(id="log")
                        yield OutputPanel(id="output")
            # The lesson's text, checkpoints and quiz (minipaged watch --lesson N); hidden otherwise.
            with Container(id="side"):
                if self.lesson is not None:
                    from .lesson_panel import LessonPanel
                    yield LessonPanel(self.lesson)
        yield Footer()

    def on_mount(self) -> None:
        self.set_class(self.presenter, "presenter")       # watch.tcss hides the lower panels
        self.query_one("#side").display = self.lesson is not None
        width, height = self.size
        if self.lesson is not None and (width < LESSON_SIZE[0] or height < LESSON_SIZE[1]):
            self.notify(f"This terminal is {width}x{height}; a lesson and its panels read best at "
                        f"{LESSON_SIZE[0]}x{LESSON_SIZE[1]} or more (enlarge the window or use a smaller font).",
                        title="Small terminal", timeout=10)
        self.query_one("#cpu-map").display = bool(self.info and self.info.num_cpu_blocks)
        self._restart_ticker()
        if self.live is not None:
            self.run_worker(self._engine_loop, thread=True, exclusive=True, name="engine", group="engine")
        self.refresh_panels()

    # ------------------------------------------------------------------ the engine worker (live only)
    def _engine_loop(self) -> None:
        """Runs in a worker thread: load the model, then one engine step per "step" command."""
        worker = get_current_worker()
        self._engine_thread = threading.current_thread()
        live = self.live
        assert live is not None
        # Loading can take half a minute (first GGUF conversion). It runs in a daemon thread so that
        # quitting meanwhile exits at once instead of waiting for the load to finish.
        outcome: dict[str, Any] = {}

        def load() -> None:
            try:
                outcome["info"] = live.load(
                    progress=lambda message: self._from_thread(self._engine_progress, message))
            except Exception as exc:    # shown on screen; the app stays open so the message can be read
                outcome["error"] = exc

        loader = threading.Thread(target=load, name="minipaged-load", daemon=True)
        loader.start()
        while loader.is_alive():
            loader.join(0.1)
            if worker.is_cancelled:
                return
        if "error" in outcome:
            self._from_thread(self._engine_failed, f"could not start the engine: {outcome['error']}")
            return
        self._from_thread(self._engine_ready, outcome["info"])
        try:
            while not worker.is_cancelled:
                try:
                    command = self._commands.get(timeout=0.2)
                except queue.Empty:
                    continue
                if command == "stop":
                    break
                try:
                    event = live.step()
                except Exception as exc:
                    self._from_thread(self._engine_failed, f"engine step failed: {exc}")
                    break
                self._from_thread(self._engine_stepped, event)
        finally:
            live.close()

    def _from_thread(self, callback: Callable[..., None], *args: Any) -> None:
        try:
            self.call_from_thread(callback, *args)
        except (RuntimeError, NoMatches):   # the app is closing (its panels may be gone); nobody is left to tell
            pass

    def _engine_progress(self, message: str) -> None:
        self.status = f"loading: {message}"
        self.query_one("#gpu-map", BlockMap).placeholder = f"loading the model: {message}"
        self.refresh_panels()

    def _engine_ready(self, info: EngineInfo) -> None:
        self.info = info
        self.state = WatchState(info)
        self.query_one("#cpu-map").display = bool(info.num_cpu_blocks)
        for panel in self.query("LessonPanel"):
            panel.start(info)                # the lesson knows which of its runs this is before step 1
        self.status = self.description or "running"
        self.refresh_panels()

    def _engine_failed(self, message: str) -> None:
        self.engine_error = message
        self.engine_busy = False
        if self.info is None:                # it never started: the map must not still say "loading"
            self.query_one("#gpu-map", BlockMap).placeholder = "the engine did not start (see the message above)"
        self.status = message
        self.notify(message, severity="error", timeout=30)
        self.refresh_panels()

    def _engine_stepped(self, event: Optional[StepEvent]) -> None:
        self.engine_busy = False
        if event is None:
            self.engine_done = True
            self.status = "all requests finished: b steps back through the run, q quits"
            self.refresh_panels()
            return
        self.events.append(event)
        if self.position == len(self.events) - 1:
            self._apply(event)
        if self.queued_steps and self.paused:
            self.queued_steps -= 1
            self._advance()
        elif not self.paused and self.speed == 0:
            self._advance()

    # ------------------------------------------------------------------ moving through events
    def _restart_ticker(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
        interval = 1 / 30 if self.speed == 0 else 1 / self.speed
        self._ticker = self.set_interval(interval, self._tick, name="player")

    def _tick(self) -> None:
        if self.engine_busy:                 # the header's "step running 2.4 s" counts up
            for topbar in self.query("#topbar").results(Static):     # none while the app is closing
                topbar.update(self._topbar())
        if self.paused or self.state is None:
            return
        for _ in range(MAX_SPEED_BATCH if self.speed == 0 else 1):
            if not self._advance():
                break

    def _advance(self) -> bool:
        """Show the next event; live and at the newest event, ask the engine for one (True if shown now)."""
        if self.state is None:
            return False
        if self.position < len(self.events):
            self._apply(self.events[self.position])
            return True
        if self.live is not None and not self.engine_done and not self.engine_busy and not self.engine_error:
            self.engine_busy = True
            self._busy_since = time.monotonic()
            self._commands.put("step")
        elif self.engine_done and not self.paused and self.live is None:
            self.status = "end of the trace: b steps back, q quits"
            self.refresh_panels()
        return False

    def _apply(self, event: StepEvent) -> None:
        assert self.state is not None
        self.state.apply(event)
        self.position += 1
        self._shown_at.append(time.monotonic())
        self._keep_selection_valid()
        for listener in self.step_listeners:
            listener(event, self.state)
        self.request_refresh()

    def _keep_selection_valid(self) -> None:
        """Something is always selected once a request exists, so the output panel has a story to tell.

        A selection the app made follows the action: when its request finishes it moves to the oldest
        running one. A request the user picked stays selected until they pick another.
        """
        assert self.state is not None
        current = self.state.view.requests.get(self.selected) if self.selected is not None else None
        if current is not None and (self.user_selected or current.state != "finished"):
            return
        running = self.state.queues()["running"]
        if running:
            self.selected, self.user_selected = running[0], False
        elif current is None:
            self.selected = self.state.arrival_order[0] if self.state.arrival_order else None

    def go_to(self, position: int) -> None:
        """Show the state after ``position`` events: refold from the start (how replay steps backwards)."""
        assert self.info is not None
        position = max(0, min(position, len(self.events)))
        self.state = WatchState.from_events(self.info, self.events[:position])
        self.position = position
        self._keep_selection_valid()
        for listener in self.rewind_listeners:
            listener(self.state)
        self.refresh_panels()

    def set_side_panel(self, *widgets: Widget) -> None:
        """Fill the optional right-hand column (lessons use it) and show it."""
        side = self.query_one("#side")
        side.remove_children()
        side.mount(*widgets)
        side.display = True

    # ------------------------------------------------------------------ drawing
    def request_refresh(self) -> None:
        """Redraw now, or soon: at full speed many events land between two frames."""
        wait = REFRESH_INTERVAL - (time.monotonic() - self._last_refresh)
        if wait <= 0:
            self.refresh_panels()
        elif not self._refresh_pending:
            self._refresh_pending = True
            self.set_timer(wait, self.refresh_panels)

    def refresh_panels(self) -> None:
        self._refresh_pending = False
        self._last_refresh = time.monotonic()
        try:
            self._draw_panels()
        except NoMatches:            # a timer or a finished step that fired while the app is closing
            pass

    def _draw_panels(self) -> None:
        state, selected = self.state, self.selected
        self.query_one("#topbar", Static).update(self._topbar())
        self.query_one("#gpu-map", BlockMap).show(state, selected)
        self.query_one("#cpu-map", BlockMap).show(state, selected)
        self.query_one(BatchPanel).show(state)
        self.query_one(Gauges).show(state)
        self.query_one(RequestTable).show(state, selected)
        self.query_one(EventLog).show(state)
        self.query_one(OutputPanel).show(state, selected)

    def mode_label(self) -> tuple[str, str]:
        """The header's first word and its style (the attach app says when its server is gone)."""
        return ("LIVE", "bold #59a14f") if self.live is not None else ("REPLAY", "bold #b07aa1")

    def _topbar(self) -> Text:
        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(" minipaged watch ", style="bold reverse")
        mode, style = self.mode_label()
        text.append(f" {mode} ", style=style)
        info = self.info
        if info is not None:
            text.append(f"{Path(info.model).name if '/' in info.model else info.model}  ", style="bold")
            if info.num_threads:
                text.append(f"{info.num_threads} thread{'s' if info.num_threads > 1 else ''}  ", style="dim")
            if getattr(info, "parallel", None):
                text.append(f"{info.parallel}  ", style="dim")
            text.append(f"step {self.position}" + (f"/{len(self.events)}" if self.live is None else ""))
            if self.engine_error:
                text.append("  STOPPED", style="bold red")
            elif self.engine_done and self.position >= len(self.events):
                text.append("  DONE", style="bold #59a14f")          # the last step is on screen
            else:
                text.append("  PAUSED" if self.paused else f"  ▶ {speed_label(self.speed)}",
                            style="bold #edc948" if self.paused else "bold")
                achieved = self.achieved_rate()
                if not self.paused and achieved is not None and (self.speed == 0 or achieved < 0.8 * self.speed):
                    text.append(f" (achieved {achieved:.2g}/s)", style="bold #e15759")
            if self.engine_busy:
                text.append(self.busy_text(time.monotonic() - self._busy_since), style="bold #f28e2b")
            text.append(f"  │ {info.num_blocks} blocks x {info.block_size} tok, budget "
                        f"{info.max_num_batched_tokens} tok, {info.max_num_seqs} seqs, chunked prefill "
                        f"{'on' if info.enable_chunked_prefill else 'off'}, prefix cache "
                        f"{'on' if info.enable_prefix_caching else 'off'}, preempt {info.preemption_mode}"
                        + (f", speculative {info.speculative}" if info.speculative else ""), style="dim")
        text.append("\n")
        text.append(f" {self.status}", style="red" if self.engine_error else "italic")
        return text

    def busy_text(self, waited_s: float) -> str:
        """What the header says while the next step is being computed."""
        queued = f", {self.queued_steps} queued" if self.queued_steps else ""
        return f"  ⏳ step {len(self.events) + 1} running {waited_s:.1f} s{queued}"

    # ------------------------------------------------------------------ actions (keys)
    def action_toggle_pause(self) -> None:
        self.paused = not self.paused
        self.refresh_panels()

    def action_step(self) -> None:
        """Exactly one step forward; pauses first, so that it stays one. Pressed while the engine is still
        computing a step, it is queued, not lost: every press is one step."""
        self.paused = True
        if self.engine_busy and self.position >= len(self.events):
            self.queued_steps += 1
            self.refresh_panels()
        elif not self._advance():
            self.refresh_panels()

    def action_back(self) -> None:
        self.paused = True
        if self.position > 0:
            self.go_to(self.position - 1)
        else:
            self.refresh_panels()

    def action_faster(self) -> None:
        self._set_speed(+1)

    def action_slower(self) -> None:
        self._set_speed(-1)

    def _set_speed(self, direction: int) -> None:
        i = SPEEDS.index(self.speed) + direction
        self.speed = SPEEDS[max(0, min(i, len(SPEEDS) - 1))]
        self._shown_at.clear()                  # the achieved rate starts again at the new pace
        self._restart_ticker()
        if self.paused:
            self.notify(f"speed {speed_label(self.speed)} (paused: space runs)", timeout=2)
        self.refresh_panels()

    def achieved_rate(self) -> Optional[float]:
        """Steps per second that really reached the screen lately (a slow engine falls short of --speed)."""
        if len(self._shown_at) < 3:
            return None
        span = self._shown_at[-1] - self._shown_at[0]
        return (len(self._shown_at) - 1) / span if span > 0 else None

    def action_select(self, offset: int) -> None:
        if self.state is None:
            return
        order = self.state.ordered_requests()
        if not order:
            return
        i = order.index(self.selected) + offset if self.selected in order else 0
        self.select(order[max(0, min(i, len(order) - 1))])

    def select(self, request_id: str) -> None:
        """The user picked a request (keys, a click, or a caller): it stays selected after it finishes."""
        self.user_selected = True
        if self.selected != request_id:
            self.selected = request_id
            self.refresh_panels()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            panels = list(self.query("LessonPanel"))           # a lesson adds its own keys
            keys = self.BINDINGS + (panels[0].BINDINGS if panels else [])
            self.push_screen(HelpScreen(keys, replay=self.live is None))

    def action_screenshot(self) -> None:
        from .pictures import pictures_folder, save_screen

        try:
            paths = save_screen(self, pictures_folder())
        except OSError as exc:
            self.notify(f"could not save a picture: {exc}", severity="error", timeout=6)
            return
        self.notify(", ".join(path.name for path in paths) + f" in {paths[0].parent}", title="Saved", timeout=6)

    def action_plot(self) -> None:
        """Draw the steps shown so far (as ``minipaged plot`` draws a trace) in a thread: the UI keeps going."""
        events = list(self.events[:self.position])
        if not events:
            self.notify("no steps yet: nothing to plot", severity="warning", timeout=4)
            return
        from .pictures import pictures_folder
        try:
            path = pictures_folder() / f"minipaged-run-{time.strftime('%Y%m%d-%H%M%S')}.png"
        except OSError as exc:
            self.notify(f"could not make the pictures folder: {exc}", severity="error", timeout=6)
            return
        self.run_worker(lambda: self._save_plot(events, path), thread=True, group="plot")

    def _save_plot(self, events: list[StepEvent], path: Path) -> None:
        from minipaged.plot import PlotError, draw_run

        try:
            draw_run(self.info, events, path)
        except PlotError as exc:
            self.call_from_thread(self.notify, str(exc), severity="error", timeout=8)
            return
        self.call_from_thread(self.notify, f"{path.name} in {path.parent} (steps 1-{len(events)})",
                              title="Plot saved", timeout=6)

    async def action_quit(self) -> None:
        self._commands.put("stop")
        self.exit(0)

    def wait_for_engine(self, timeout: float) -> bool:
        """After the app has exited: let the step in flight finish (the trace stays whole, and no thread is
        inside torch when the process ends). False if it was still busy after ``timeout`` seconds."""
        self._commands.put("stop")
        thread = self._engine_thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    # ------------------------------------------------------------------ messages from widgets
    def on_request_table_selected(self, message: RequestTable.Selected) -> None:
        self.select(message.request_id)

    def on_block_map_request_clicked(self, message: BlockMap.RequestClicked) -> None:
        self.select(message.request_id)
