"""How the API server reaches the engine core: in a process of its own (``ProcessCore``, what ``minipaged serve``
runs) or in a thread beside the event loop (``ThreadCore``, for a server built around an ``Engine`` object:
tests, and programs that embed one). Both run the same ``CoreLoop`` and give the API server the same surface:
``served`` (what it needs to know of the model), ``start(deliver, loop)``, ``send(command)``, ``alive``,
``close()`` (vLLM v1 has the same pair: ``SyncMPClient`` / ``InprocClient`` behind ``EngineCoreClient``).

Why a process: Python runs one thread at a time (the GIL). With the engine in the server's process, every
streamed token's chunk, write and task switch waits for the engine's Python and the engine waits for theirs;
where the forward pass is cheap (a small model, a fast GPU) the server then delivered 0.19x the engine's
throughput (docs/performance.md). In a process of its own the core steps while the API server streams.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .core_loop import CoreLoop, Message
from .core_process import START_POLL_S, CoreStartError, Wire, write_arguments

Deliver = Callable[[list[Message]], None]


@dataclass(frozen=True)
class ServedModel:
    """What the API server knows of the model: enough to tokenise, check and describe requests."""

    tokenizer: Any
    info: Any                     # events.EngineInfo: block size, number of blocks ...
    vocab_size: int
    max_model_len: int
    model: str                    # the model as the engine was given it (a path or a name)

    @classmethod
    def of(cls, engine: Any) -> "ServedModel":
        return cls(engine.tokenizer, engine.info, engine.inputs.vocab_size, engine.config.max_model_len,
                   engine.config.model)


class ThreadCore:
    """The core loop in a thread of this process, over an ``Engine`` object the caller built."""

    def __init__(self, engine: Any) -> None:
        self.served = ServedModel.of(engine)
        self.initial_stats = dict(engine.stats())    # the engine may have run before: metrics count from here
        self._deliver: Optional[Deliver] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._core = CoreLoop(engine, self._emit)
        self._thread: Optional[threading.Thread] = None

    def start(self, deliver: Deliver, loop: asyncio.AbstractEventLoop) -> None:
        self._deliver, self._loop = deliver, loop
        self._thread = threading.Thread(target=self._core.run, name="minipaged-engine", daemon=True)
        self._thread.start()

    def _emit(self, messages: list[Message]) -> None:
        assert self._loop is not None and self._deliver is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, messages)
        except RuntimeError:                      # the event loop is closed: the server is going down
            pass

    def send(self, command: Message) -> None:
        self._core.commands.put(command)

    @property
    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def exit_reason(self) -> str:
        return "the engine core's thread has stopped"

    def close(self, timeout_s: float = 10.0) -> None:
        self._core.commands.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout_s)


class ProcessCore:
    """The engine core in a process of its own, reached over ZeroMQ through a private folder (``Wire``).

    Made before the server starts: it starts the process and waits until the model is loaded (printing the
    core's progress), or raises ``CoreStartError`` with the core's own message if loading fails."""

    def __init__(self, model: str, options: dict[str, Any], kv_events: Optional[str] = None,
                 progress: Optional[Callable[[str], None]] = None) -> None:
        self.folder = tempfile.mkdtemp(prefix="minipaged-core-")     # 0700: only this user reaches the sockets
        self.wire = Wire(self.folder, bind=True)
        self._receiver: Optional[threading.Thread] = None
        self._closing = False
        self.initial_stats: dict[str, float] = {}
        # A plain child process (not multiprocessing's: it would leave a resource tracker process behind it), in
        # this process's group, so that what stops the server's group stops the core too.
        write_arguments(self.folder, model, options, kv_events, os.getpid())
        self.process = subprocess.Popen([sys.executable, "-m", "minipaged.serve.core_process", self.folder])
        try:
            # The tokenizer's library (transformers, which imports torch: seconds) is imported now, while the core
            # process loads the model on the other core, not after it is ready: the server answers that much sooner.
            from transformers import AutoTokenizer  # noqa: F401
            self.served = self._wait_until_ready(progress or (lambda _m: None))
        except BaseException:
            self.close(timeout_s=2.0)
            raise

    def _wait_until_ready(self, progress: Callable[[str], None]) -> ServedModel:
        while True:
            message = self.wire.receive(timeout_s=START_POLL_S)
            if message is None:
                if not self.alive:
                    raise CoreStartError(f"the engine core process exited while it started (exit code "
                                         f"{self.process.returncode}); its output above says why.")
                continue
            kind = message[0]
            if kind == "progress":
                progress(message[1])
            elif kind == "start_failed":
                raise CoreStartError(message[1])
            elif kind == "ready":
                info, vocab_size, max_model_len, model, tokenizer_dir = message[1:]
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
                shutil.rmtree(tokenizer_dir, ignore_errors=True)
                return ServedModel(tokenizer, info, vocab_size, max_model_len, model)

    def start(self, deliver: Deliver, loop: asyncio.AbstractEventLoop) -> None:
        """Hand the core's messages to ``deliver`` on ``loop``: a thread receives and decodes them (the socket's
        wait lets go of the GIL) and wakes the loop once for each batch it finds waiting."""
        def receive() -> None:
            while not self._closing:
                batch = self.wire.receive_batch(timeout_s=0.2)
                if not batch and not self.alive:
                    if not self._closing:
                        batch = [("exited", self.exit_reason())]
                    self._closing = True
                if batch:
                    try:
                        loop.call_soon_threadsafe(deliver, batch)
                    except RuntimeError:          # the event loop is closed: the server is going down
                        return
        self._receiver = threading.Thread(target=receive, name="minipaged-core-receiver", daemon=True)
        self._receiver.start()

    def send(self, command: Message) -> None:
        """From the event loop's thread only (a ZeroMQ socket belongs to one thread)."""
        if not self._closing:
            self.wire.send(command)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def exit_reason(self) -> str:
        code = self.process.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited (code {code})"
        return f"the engine core process {how}"

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the core (it finishes its step and exits), then close the sockets before their context. Calling it
        again does nothing."""
        if self.wire.closed:
            return
        if self.alive and not self._closing:
            try:
                self.wire.send(("stop",))
            except Exception:                     # the socket may be gone already; the wait below decides
                pass
        self._closing = True
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            print("minipaged serve: the engine core did not stop in time; killing it", file=sys.stderr)
            self.process.kill()
            self.process.wait(5.0)
        if self._receiver is not None:
            self._receiver.join(1.0)
        self.wire.close()
        shutil.rmtree(self.folder, ignore_errors=True)
