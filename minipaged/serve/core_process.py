"""The engine core's process: what ``minipaged serve`` runs apart from its API server (vLLM v1's
``EngineCoreProc``), and the wire between the two.

The wire: two ZeroMQ PUSH/PULL pipes over IPC sockets in a folder only this user can enter (``mkdtemp`` makes it
0700; never a TCP port a student could reach), commands one way and outputs the other. Each message is two frames,
its kind and its fields msgpack'd by msgspec: msgspec encodes the engine's own dataclasses (``RequestDelta``,
``StepEvent``, ``SamplingParams``) as they are and decodes them back into the same types, checked against their
annotations, so nothing is converted by hand on either side; it encodes a 128-request step event in microseconds,
where ``json.dumps`` of its ``asdict`` takes about a millisecond.

In the core process three threads share the work, as in vLLM: one receives and decodes commands, one sends
encoded outputs (socket waits let go of the GIL), and the main thread runs the ``CoreLoop``, which never waits on a
socket. The core dies with the API server (``parent_watch``), so a server killed with SIGKILL leaves no engine
behind.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Optional

import msgspec
import zmq

from ..events import EngineInfo, StepEvent
from ..outputs import RequestDelta
from ..request import SamplingParams
from ..parent_watch import die_with_parent
from .core_loop import CoreLoop, Message

START_POLL_S = 0.2              # how often the API server looks whether a starting core is still alive
ARGUMENTS = "arguments.json"    # in the private folder: the model, the engine's options ...

# The fields of each kind of message, for msgspec to decode them into the types they were.
FIELDS: dict[str, Any] = {
    "add": tuple[str, list[int], SamplingParams], "abort": tuple[str], "stop": tuple[()],
    "accepted": tuple[str], "refused": tuple[str, int, str, Optional[str]],
    "step": tuple[list[RequestDelta], StepEvent], "stats": tuple[dict[str, Any]], "failed": tuple[str],
    "alive": tuple[()], "progress": tuple[str], "start_failed": tuple[str],
    "ready": tuple[EngineInfo, int, int, str, str],
}


class CoreStartError(RuntimeError):
    """The engine core could not start (its message says why: a bad model, too little memory ...)."""


class Wire:
    """Both ends of the two pipes: the API server binds, the core connects."""

    def __init__(self, folder: str, bind: bool) -> None:
        self.closed = False
        self.context = zmq.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoders = {kind.encode(): msgspec.msgpack.Decoder(fields) for kind, fields in FIELDS.items()}
        commands, outputs = f"ipc://{folder}/commands", f"ipc://{folder}/outputs"
        self._out = self.context.socket(zmq.PUSH)        # the API server's commands, or the core's outputs
        self._in = self.context.socket(zmq.PULL)
        for sock in (self._out, self._in):
            sock.setsockopt(zmq.LINGER, 0)               # closing never waits for a peer that is gone
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        if bind:
            self._out.bind(commands)
            self._in.bind(outputs)
        else:
            self._out.connect(outputs)
            self._in.connect(commands)

    def encode(self, message: Message) -> list[bytes]:
        return [message[0].encode(), self._encoder.encode(message[1:])]

    def send(self, message: Message) -> None:
        self._out.send_multipart(self.encode(message))

    def send_frames(self, frames: list[bytes]) -> None:
        self._out.send_multipart(frames)       # copied: cheaper than zero-copy for messages this small

    def receive(self, timeout_s: Optional[float] = None) -> Optional[Message]:
        """The next message (None if none came within ``timeout_s``; None as timeout: wait for one)."""
        if timeout_s is not None and not self._in.poll(int(timeout_s * 1000)):
            return None
        return self._decode(self._in.recv_multipart())

    def _decode(self, frames: list[bytes]) -> Message:
        kind, payload = frames
        return (kind.decode(), *self._decoders[kind].decode(payload))

    def receive_batch(self, timeout_s: float) -> list[Message]:
        """Every message waiting (after waiting up to ``timeout_s`` for the first)."""
        first = self.receive(timeout_s)
        if first is None:
            return []
        batch = [first]
        while True:
            try:
                batch.append(self._decode(self._in.recv_multipart(zmq.NOBLOCK)))
            except zmq.Again:
                return batch

    def close(self) -> None:
        """Sockets first, then their context (closing the context first would wait for them: a hang)."""
        self.closed = True
        self._out.close(linger=0)
        self._in.close(linger=0)
        self.context.term()


def write_arguments(folder: str, model: str, options: dict[str, Any], kv_events: Optional[str],
                    parent_pid: int) -> None:
    """What the core is to run, in its private folder (``python -m minipaged.serve.core_process FOLDER``)."""
    with open(os.path.join(folder, ARGUMENTS), "wb") as f:
        f.write(msgspec.json.encode({"model": model, "options": options, "kv_events": kv_events,
                                     "parent_pid": parent_pid}))


def main(folder: str) -> None:
    with open(os.path.join(folder, ARGUMENTS), "rb") as f:
        args = msgspec.json.decode(f.read())
    run_core_process(args["model"], args["options"], args["kv_events"], folder, args["parent_pid"])


def run_core_process(model: str, options: dict[str, Any], kv_events: Optional[str], folder: str,
                     parent_pid: int) -> None:
    """The core process's main: load the engine, say ready (or why not), run the loop until told to stop."""
    die_with_parent(parent_pid)
    # Ctrl-C and a SIGTERM to the server's group reach the core too: the API server drains (the core keeps
    # serving meanwhile), then stops it. The core ends with its API server, whatever ends that.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    wire = Wire(folder, bind=False)
    try:
        from ..options import build_engine

        engine = build_engine(model, options, progress=lambda m: wire.send(("progress", m)))
        tokenizer_dir = os.path.join(folder, "tokenizer")
        engine.tokenizer.save_pretrained(tokenizer_dir)      # the API server's own copy (it tokenises)
        stop_kv_events = start_kv_events(engine, kv_events)
    except Exception as exc:
        wire.send(("start_failed", str(exc)))
        time.sleep(0.2)                                       # let the message leave before the sockets close
        wire.close()
        sys.exit(1)
    wire.send(("ready", engine.info, engine.inputs.vocab_size, engine.config.max_model_len, engine.config.model,
               tokenizer_dir))
    outbox: queue.SimpleQueue = queue.SimpleQueue()
    core = CoreLoop(engine, lambda messages: outbox.put([wire.encode(m) for m in messages]))
    threading.Thread(target=_receive_commands, args=(wire, core), name="minipaged-core-input", daemon=True).start()
    sender = threading.Thread(target=_send_outputs, args=(wire, outbox), name="minipaged-core-output", daemon=True)
    sender.start()
    try:
        core.run()
    finally:
        outbox.put(None)
        sender.join(5.0)
        stop_kv_events()
        engine.close()
    # The input thread still waits on its socket: leave without closing what it uses (the process ends).
    os._exit(0)


def _receive_commands(wire: Wire, core: CoreLoop) -> None:
    while True:
        message = wire.receive()
        if message is not None:
            core.commands.put(message)
            if message[0] == "stop":
                return


def _send_outputs(wire: Wire, outbox: queue.SimpleQueue) -> None:
    while (batch := outbox.get()) is not None:
        for frames in batch:
            wire.send_frames(frames)


def start_kv_events(engine: Any, config: Optional[str]) -> Any:
    """--kv-events-config: vLLM's KV cache events, published from here, where the block pool's change log is."""
    from .kv_publisher import KVEventsConfig, start_kv_events as start
    return start(engine, KVEventsConfig.parse(config))


if __name__ == "__main__":
    main(sys.argv[1])
