"""The name each request is shown by: r0, r1 ... in arrival order, one per request, given by the engine's event
recorder (``StepRecorder``) and carried in the request's arrival (``RequestArrival.name``), so that every view
of one engine (the TUI attached to a server, every web page however late it opened, the fleet page) says the same
name (a class trial's pages said r0-r2 for what another page called r30, the attach TUI ``cmpl-...``, the fleet
page ``chatcmpl-...``). Ids longer than ``SHORT_ID`` (a server's ``chatcmpl-95d...``) get r0, r1 ...; the samples
of one request share its name (r3.0, r3.1); a short id (the TUI's driver's r0, a lesson's A1) is its own name
unless another request holds that name now. Traces recorded before arrivals carried names are named the same way
by the watchers' fold (``tui/state.py``; ``fold.mjs`` in the browser). Imports nothing heavy: thin clients use it.
"""
from __future__ import annotations

import re
from collections import Counter, deque
from typing import Optional

SHORT_ID = 8                    # ids this short name themselves (the TUI's r0, r1; the engine's 0, 1)
FINISHED_KEPT = 200             # finished requests the watchers still show (tui/state.py): their names stay taken
_SAMPLE = re.compile(r"(.*)\.([0-9]+)")      # output_processor.sample_ids: a request's samples are id.0, id.1 ...


def split_sample(request_id: str) -> tuple[str, str]:
    """A sample's id into its request's id and its suffix (``r3.1`` -> ``r3``, ``.1``); others stay whole."""
    sample = _SAMPLE.fullmatch(request_id)
    return (sample.group(1), f".{sample.group(2)}") if sample else (request_id, "")


class RequestNames:
    """Names given to the requests held now (``give`` on arrival, ``forget`` when they are let go)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}          # request id -> its name
        self._num_named = 0
        # Kept as names come and go, so that naming an arrival does not look at every name held:
        self._base_names: dict[str, str] = {}     # a named id without its sample suffix -> its name's, likewise
        self._ids_of_base: Counter[str] = Counter()   # named ids per such base (a request's samples share one)
        self._names_taken: Counter[str] = Counter()   # the bases' names in use
        self._finished: deque[str] = deque()      # (the recorder's) finished requests, oldest first

    def _new_name(self, request_id: str) -> str:
        base, suffix = split_sample(request_id)
        if base in self._base_names:                   # another sample of the same request
            return self._base_names[base] + suffix
        if len(base) <= SHORT_ID and not self._names_taken[base]:
            return request_id
        while self._names_taken[f"r{self._num_named}"]:
            self._num_named += 1
        self._num_named += 1
        return f"r{self._num_named - 1}{suffix}"

    def give(self, request_id: str, name: Optional[str] = None) -> str:
        """Name ``request_id`` (``name``: the one its arrival carries, else a new one) and return the name."""
        if request_id in self.names:
            return self.names[request_id]
        name = self.names[request_id] = name or self._new_name(request_id)
        base = split_sample(request_id)[0]
        if not self._ids_of_base[base]:
            self._base_names[base] = name.split(".")[0]
            self._names_taken[self._base_names[base]] += 1
        self._ids_of_base[base] += 1
        return name

    def finished(self, request_id: str) -> None:
        """``request_id`` ended: its name stays taken while the watchers still show it (the last FINISHED_KEPT
        finished requests, as they keep them), so that no new request is shown by the same name beside it."""
        self._finished.append(request_id)
        while len(self._finished) > FINISHED_KEPT:
            self.forget(self._finished.popleft())

    def forget(self, request_id: str) -> None:
        if self.names.pop(request_id, None) is None:
            return
        base = split_sample(request_id)[0]
        self._ids_of_base[base] -= 1
        if not self._ids_of_base[base]:
            del self._ids_of_base[base]
            name = self._base_names.pop(base)
            self._names_taken[name] -= 1
            if not self._names_taken[name]:
                del self._names_taken[name]
