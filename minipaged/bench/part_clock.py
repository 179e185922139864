"""Wall and thread-CPU time per named part of an engine step, for the benchmarks that take a step apart
(``bench/host_overhead.py``, ``bench/one_request_profile.py``): each wraps the engine's methods in ``timing``."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional


class PartClock:
    """Wall and thread-CPU seconds per part, for the step being measured (nested parts count in their parent
    too: event_stats is inside event)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}

    def reset(self) -> None:
        self.wall, self.cpu = {}, {}

    @contextmanager
    def timing(self, part: str) -> Iterator[None]:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wall[part] = self.wall.get(part, 0.0) + time.perf_counter() - wall
            self.cpu[part] = self.cpu.get(part, 0.0) + time.thread_time() - cpu

    def wrap(self, owner: Any, name: str, part: str, keep: Optional[list] = None) -> Callable[[], None]:
        """Time every call of ``owner.name`` as ``part`` (an attribute set on the instance); ``keep`` collects
        what it returns. Returns the undo."""
        original = getattr(owner, name)
        own = name in vars(owner)               # an instance attribute already (not a method of its class)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.timing(part):
                result = original(*args, **kwargs)
            if keep is not None:
                keep.append(result)
            return result
        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original) if own else delattr(owner, name)
