"""The processes ``minipaged fleet`` starts, and stopping every one of them, whatever happened.

Each child runs in its own session (its own process group), so that a Ctrl-C in the terminal reaches the
fleet command only, and the fleet stops its children in an order it chooses: the router first (no new
requests reach the replicas), then the replicas (each drains on SIGTERM, as ``minipaged serve`` does). A
child that does not exit within its grace time is killed with its whole group, helpers included. Nothing is
found by name: only the process groups this object started are signalled.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass
class Child:
    """One started process: what it is (for messages), its process, and where its output goes."""

    name: str
    proc: subprocess.Popen
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class ChildProcesses:
    """Every process the fleet started, in start order."""

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, command: list[str], env: Optional[dict[str, str]] = None) -> Child:
        log_path = self.log_dir / f"{name.replace(' ', '-')}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True)
        child = Child(name, proc, log_path)
        self.children.append(child)
        return child

    def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM to each group, newest first (the router before the replicas); then SIGKILL to the groups
        of those still running after ``grace_s``."""
        for child in reversed(self.children):
            _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in reversed(self.children):
            with suppress(subprocess.TimeoutExpired):
                child.proc.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children:
            _signal_group(child.proc, signal.SIGKILL)       # the process if still there, and any helper left
            with suppress(subprocess.TimeoutExpired):
                child.proc.wait(5)

    def first_exited(self) -> Optional[Child]:
        """A child that has stopped on its own (the fleet is broken without it), or None."""
        return next((c for c in self.children if c.proc.poll() is not None), None)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group the child leads (its pid is the group's id: it was started in a new session)."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
