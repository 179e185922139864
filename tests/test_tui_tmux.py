"""``minipaged watch`` in a real terminal: started in tmux as a user would, driven with keys, read back with
capture-pane. Catches what Pilot cannot: the console entry point, terminal set-up and a clean exit.

Needs the ``tmux`` binary (``apt-get install -y tmux``); skipped with a reason when it is missing.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO / "tests" / "data" / "watch_trace.jsonl"

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None,
                                reason="tmux is not installed (apt-get install -y tmux)")


class Tmux:
    """One tmux server on a private socket, so a user's own sessions are never touched."""

    def __init__(self, name: str) -> None:
        self.socket = f"minipaged-test-{os.getpid()}-{name}"
        self.session = "watch"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=check,
                              timeout=30)

    def screen(self) -> str:
        result = self.run("capture-pane", "-p", "-t", self.session, check=False)
        return result.stdout

    def wait_for(self, text: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.screen()
            if text in screen:
                return screen
            time.sleep(0.2)
        raise AssertionError(f"{text!r} never appeared; the screen was:\n{screen}")

    def keys(self, *keys: str) -> None:
        self.run("send-keys", "-t", self.session, *keys)

    def alive(self) -> bool:
        return self.run("has-session", "-t", self.session, check=False).returncode == 0

    def kill(self) -> None:
        self.run("kill-server", check=False)


def start_watch(tmux: Tmux, status_file: Path, *flags: str) -> None:
    """``minipaged watch FLAGS`` in a fresh tmux session; its exit status lands in ``status_file``."""
    command = (f"cd {shlex.quote(str(REPO))} && {shlex.quote(sys.executable)} -m minipaged watch "
               f"{' '.join(shlex.quote(f) for f in flags)}; echo $? > {shlex.quote(str(status_file))}")
    tmux.run("new-session", "-d", "-s", tmux.session, "-x", "180", "-y", "50", "-e", "TERM=xterm-256color",
             "-e", "HF_HUB_OFFLINE=1", command)


def quit_cleanly(tmux: Tmux, status_file: Path) -> None:
    tmux.keys("q")
    deadline = time.monotonic() + 30
    while not status_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert status_file.exists(), f"the app did not quit; the screen was:\n{tmux.screen()}"
    assert status_file.read_text().strip() == "0"


def test_watch_replay_in_tmux(tmp_path):
    status_file = tmp_path / "exit-status"
    tmux = Tmux("replay")
    try:
        start_watch(tmux, status_file, "--replay", str(TRACE), "--paused")
        screen = tmux.wait_for("KV blocks (CPU memory)")
        assert "REPLAY" in screen and "step 0/" in screen and "PAUSED" in screen
        tmux.keys("n")
        screen = tmux.wait_for("step 1/")
        tmux.keys("n", "n")
        screen = tmux.wait_for("step 3/")
        assert "Requests" in screen and "Events" in screen and "Metrics" in screen
        tmux.keys("b")
        tmux.wait_for("step 2/")
        tmux.keys("?")
        tmux.wait_for("minipaged watch: keys")
        tmux.keys("Escape")
        deadline = time.monotonic() + 20
        while "minipaged watch: keys" in tmux.screen() and time.monotonic() < deadline:
            time.sleep(0.2)
        quit_cleanly(tmux, status_file)
    finally:
        tmux.kill()


def test_watch_a_lesson_live_in_tmux(tmp_path, tiny_model):
    """A live engine (the tiny model) under lesson 3: paused at start, n steps it, a checkpoint ticks."""
    status_file = tmp_path / "exit-status"
    tmux = Tmux("lesson")
    try:
        start_watch(tmux, status_file, "--model", tiny_model, "--lesson", "3")
        screen = tmux.wait_for("PAUSED")                       # the model has loaded; a lesson starts paused
        assert "LIVE" in screen and "Lesson 3: Prefix caching" in screen and "Checkpoints 0/" in screen
        for step in (1, 2, 3):
            tmux.keys("n")
            screen = tmux.wait_for(f"step {step} ")
        screen = tmux.wait_for("Checkpoints 2/")              # r0's blocks hashed; r2's cache hit at step 3
        assert "r2 cache hit: 12 blocks" in screen
        quit_cleanly(tmux, status_file)
    finally:
        tmux.kill()


def time_to_quit(tmux: Tmux, status_file: Path) -> tuple[str, float]:
    """Press q; the exit status and the seconds until the process had exited."""
    start = time.monotonic()
    tmux.keys("q")
    while not status_file.exists() and time.monotonic() - start < 30:
        time.sleep(0.02)
    took = time.monotonic() - start
    assert status_file.exists(), f"the app did not quit; the screen was:\n{tmux.screen()}"
    return status_file.read_text().strip(), took


@pytest.mark.slow
def test_quitting_mid_step_is_clean_and_quick_ten_times_in_a_row(tmp_path):
    """SmolLM2 at full speed is inside a step (~0.3 s each) almost all the time, so q lands mid-step. Before
    the fix this crashed ("terminate called without an active exception", exit 134) about one time in four
    and took about two seconds otherwise (the interpreter's teardown of torch and transformers)."""
    results = []
    for attempt in range(10):
        status_file = tmp_path / f"exit-status-{attempt}"
        tmux = Tmux(f"quit{attempt}")
        try:
            start_watch(tmux, status_file, "--speed", "0")
            tmux.wait_for(" batch: ", timeout=120)          # the batch panel's title, once a step has run
            time.sleep(0.07 * attempt)
            results.append(time_to_quit(tmux, status_file))
        finally:
            tmux.kill()
    assert all(code == "0" for code, _ in results), results
    assert max(took for _, took in results) < 2.0, results


def test_quitting_while_the_model_loads_exits_at_once(tmp_path):
    status_file = tmp_path / "exit-status"
    tmux = Tmux("quit-loading")
    try:
        start_watch(tmux, status_file)                   # the embedded model: its load takes a few seconds
        tmux.wait_for("loading")
        code, took = time_to_quit(tmux, status_file)
        assert code == "0" and took < 2.0, (code, took)
    finally:
        tmux.kill()
