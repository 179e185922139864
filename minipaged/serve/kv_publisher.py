"""``--kv-events-config``: publish the KV cache's events over ZMQ, as vLLM does (``kv_events.py``).

The configuration is vLLM's JSON (``KVEventsConfig``): ``{"enable_kv_cache_events": true, "publisher":
"zmq", "topic": "kv-events"}``. The events carry every client's prompt tokens to whoever reaches the endpoint:
``serve`` says so at start (``exposure_note``). Each step's events go out as one msgpack'd
``KVEventBatch`` in a three-part ZMQ message, vLLM's: the topic, an 8-byte big-endian sequence number, the
payload. A subscriber that is slow loses batches (the PUB socket drops beyond ``hwm``) and sees the gap in
the sequence numbers; the engine never waits for it. vLLM's rule picks bind or connect: an endpoint with
``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is connected to. Given no endpoint, minipaged
binds ``tcp://127.0.0.1:5557`` (vLLM's default, ``tcp://*:5557``, would open it to every interface).

pyzmq and msgpack are the ``[kv-events]`` extra; they are imported only when events are enabled.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
INSTALL_HINT = "pip install 'minipaged[kv-events]' (pyzmq and msgpack)"
# vLLM's KVEventsConfig fields; those minipaged does not act on are accepted only at values that ask nothing.
KNOWN = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
         "max_queue_size", "topic"}


class KVEventsConfigError(ValueError):
    """A --kv-events-config that cannot work; the message says what to change."""


@dataclass(frozen=True)
class KVEventsConfig:
    enabled: bool = False
    endpoint: str = DEFAULT_ENDPOINT
    bind: bool = True
    topic: str = ""
    hwm: int = 100_000

    @staticmethod
    def parse(text: Optional[str]) -> "KVEventsConfig":
        if not text:
            return KVEventsConfig()
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise KVEventsConfigError(f"--kv-events-config is not JSON ({exc}): give e.g. "
                                      f"'{{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\"}}'.") from None
        if not isinstance(raw, dict):
            raise KVEventsConfigError("--kv-events-config must be a JSON object (vLLM's KVEventsConfig).")
        unknown = sorted(set(raw) - KNOWN)
        if unknown:
            raise KVEventsConfigError(f"--kv-events-config: unknown field {unknown[0]!r}; vLLM's fields are "
                                      f"{', '.join(sorted(KNOWN))}.")
        if raw.get("replay_endpoint") is not None:
            raise KVEventsConfigError("--kv-events-config: replay_endpoint is not supported by minipaged (no replay "
                                      "buffer); leave it out, and let a subscriber that sees a gap start afresh.")
        enabled = bool(raw.get("enable_kv_cache_events", False))
        publisher = raw.get("publisher", "zmq" if enabled else "null")
        if publisher not in ("zmq", "null"):
            raise KVEventsConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {publisher!r}.")
        endpoint = raw.get("endpoint")
        return KVEventsConfig(enabled=enabled and publisher == "zmq", endpoint=endpoint or DEFAULT_ENDPOINT,
                              bind=endpoint is None or vllm_binds(endpoint), topic=str(raw.get("topic", "")),
                              hwm=int(raw.get("hwm", 100_000)))


def vllm_binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_installed() -> None:
    try:
        import msgpack  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        raise KVEventsConfigError(f"--kv-events-config needs {exc.name}, which is not installed: "
                                  f"{INSTALL_HINT}.") from None


class ZmqKVEventPublisher:
    """Drains the block pool's events after each step (in the engine core's process) and sends them as one batch."""

    def __init__(self, engine: Any, config: KVEventsConfig) -> None:
        import msgpack
        import zmq

        self._pack = msgpack.Packer()
        self._zmq = zmq
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(config.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            (self._socket.bind if config.bind else self._socket.connect)(config.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(linger=0)
            raise KVEventsConfigError(f"--kv-events-config: cannot {'bind' if config.bind else 'connect to'} "
                                      f"{config.endpoint} ({exc}); choose another endpoint.") from None
        self._topic = config.topic.encode("utf-8")
        self._seq = 0
        self._kv = engine.recorder.kv             # the observer that folds the block pool's change log
        self._kv.kv_events = []
        self._unsubscribe = engine.subscribe(self._after_step)

    def _after_step(self, _event: Any) -> None:
        from minipaged.kv_events import encode_batch

        events, self._kv.kv_events = self._kv.kv_events, []
        if not events:
            return
        payload = self._pack.pack(encode_batch(time.time(), events))
        try:
            self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload),
                                        flags=self._zmq.NOBLOCK)
        except self._zmq.Again:                 # no room: the batch is lost, the sequence number shows it
            pass
        self._seq += 1

    def close(self) -> None:
        self._unsubscribe()
        self._kv.kv_events = None
        self._socket.close(linger=0)


def exposure_note(config: KVEventsConfig) -> str:
    """What ``serve`` tells at start when events are on: they carry every client's prompt tokens, and the
    endpoint, not the API key, decides who reads them."""
    who = (f"any process that can connect to {config.endpoint}" if config.bind
           else f"whatever listens at {config.endpoint}")
    wide = " (every interface: anyone on the network)" if "*" in config.endpoint or "::" in config.endpoint else ""
    return (f"KV cache events carry the token ids of every client's prompt (BlockStored), with no key, to {who}"
            f"{wide}; keep the endpoint on 127.0.0.1 or a network you trust.")


def start_kv_events(engine: Any, config: KVEventsConfig) -> Callable[[], None]:
    """Start publishing if the configuration asks for it; returns what stops it."""
    if not config.enabled:
        return lambda: None
    return ZmqKVEventPublisher(engine, config).close
