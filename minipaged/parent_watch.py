"""A child process that must not outlive its parent: the engine core (its parent is the API server) and the
workers of a parallel engine (their parent is rank 0). Killed with SIGKILL, a parent runs no clean-up, so each
child watches for itself (vLLM's orphaned engine processes, its issues #55510 and #34643, are what happens
otherwise: a GPU held by nobody)."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

PARENT_POLL_S = 0.5             # how often a child looks whether its parent is still alive


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` ends, however it ends (SIGKILL included): a parent-death signal where
    Linux gives one, and a thread that watches the parent's id everywhere (and if the parent died already)."""
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(1)
    threading.Thread(target=watch, name="minipaged-parent-watch", daemon=True).start()
