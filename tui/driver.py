"""Where live events come from: an engine fed by a workload. (Replays read a trace with
``minipaged.trace.read_trace``.)

``LiveRun`` owns the engine. It runs in the TUI's thread worker (or in the main thread for ``--no-tui``):
it adds each workload request when its arrival step comes, calls ``engine.step()``, and writes every event
to the trace file when recording. It hands out StepEvents and the EngineInfo, nothing else, so everything
downstream works the same on a replayed trace.
"""
from __future__ import annotations

from collections import deque
from typing import IO, Any, Callable, Optional

from minipaged.events import EngineInfo, StepEvent
from minipaged.request import InvalidRequestError
from minipaged.trace import write_trace_event, write_trace_header
from minipaged.workloads import Arrival, Workload, format_prompt

Progress = Callable[[str], None]
EngineFactory = Callable[[Progress], Any]     # builds an Engine, reporting load progress


class LiveRun:
    """Feeds a workload into an engine, one step at a time.

    Arrival steps count engine steps. When the engine falls idle before the next arrival is due, the gap is
    skipped (an idle engine has nothing to show), so the workload's shape survives whatever the speed.
    """

    def __init__(self, build_engine: EngineFactory, workload: Workload, record: Optional[str] = None) -> None:
        self._build_engine = build_engine
        self.workload = workload
        self._record_path = record
        self._trace: Optional[IO[str]] = None
        self._pending: deque[tuple[Arrival, Any]] = deque()   # (arrival, its prompt as the engine takes it)
        self._offset = 0          # steps skipped while the engine was idle
        self._next_id = 0
        self.engine: Any = None
        self.info: Optional[EngineInfo] = None
        self.steps = 0

    def load(self, progress: Progress = lambda message: None) -> EngineInfo:
        """Build the engine (slow: loads the model) and open the trace file."""
        self.engine = self._build_engine(progress)
        self.info = self.engine.info
        self._pending = deque(self._checked_prompts())
        if self._record_path:
            self._trace = open(self._record_path, "w", encoding="utf-8")
            write_trace_header(self._trace, self.info)
            self._trace.flush()
        return self.info

    def _checked_prompts(self) -> list[tuple[Arrival, Any]]:
        """Every workload prompt, formatted for the model and checked against this engine before the run
        starts: a request the engine would refuse must not end a class's run halfway through."""
        pending = []
        for i, arrival in enumerate(sorted(self.workload.arrivals, key=lambda a: a.step)):
            prompt = format_prompt(getattr(self.engine, "tokenizer", None), arrival)
            try:
                self.engine.validate_request(prompt, arrival.params)
            except ValueError as exc:
                raise InvalidRequestError(f"request r{i} of the workload cannot run on this engine: {exc}") from None
            pending.append((arrival, prompt))
        return pending

    @property
    def done(self) -> bool:
        return not self._pending and (self.engine is None or not self.engine.has_unfinished_requests())

    def _add_due_requests(self) -> None:
        step = self.steps + 1
        if self._pending and not self.engine.has_unfinished_requests():
            self._offset = max(self._offset, self._pending[0][0].step - step)
        while self._pending and self._pending[0][0].step <= step + self._offset:
            arrival, prompt = self._pending.popleft()
            self.engine.add_request(prompt, arrival.params, request_id=f"r{self._next_id}")
            self._next_id += 1

    def step(self) -> Optional[StepEvent]:
        """Run one engine step; None once every request of the workload has finished."""
        assert self.engine is not None, "call load() first"
        self._add_due_requests()
        if not self.engine.has_unfinished_requests():
            return None
        event = self.engine.step().event
        self.steps += 1
        if self._trace is not None:
            write_trace_event(self._trace, event)
            self._trace.flush()
        return event

    def close(self) -> None:
        """Close the trace and the engine: an engine with async scheduling has a model thread, which must
        not outlive the app that quit (a notebook or a test keeps the process running)."""
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
