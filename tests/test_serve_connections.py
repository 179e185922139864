"""Connections and event streams bounded (minipaged/serve/connections.py, event_hub.StreamLimits), against a real
``minipaged serve`` with a small cap, so that filling it costs the test a few dozen sockets.

Why these tests: an adversarial review held 1,100 silent sockets open and ``/health`` went unanswered for 99 s
(the process ran out of file descriptors), and held 240 event streams from one machine. Here a cap of 20
connections is filled twice over with sockets that send nothing, or headers a byte at a time: requests get an
OpenAI-shaped 503, ``/health`` still answers, and the silent sockets are closed after the header timeout while
a live event stream is not. Timings are only generous bounds on "answered at all".
"""
from __future__ import annotations

import contextlib
import json
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from minipaged.serve.connections import (MIN_ROOM, STREAM_SEND_BUFFER, ConnectionLimitProtocol, fit_connections,
                                         room_for)
from minipaged.serve.event_hub import StreamLimits, Watcher
from minipaged.serve.protocol import ServerError
from serve_util import running_server

CAP = 20                     # --max-connections
PER_CLIENT = 6               # --max-client-connections (a student with five event streams open still fits)
HEADER_TIMEOUT_S = 2         # --header-timeout
SOCKETS = 2 * CAP            # silent sockets opened: past the cap and its room
ANSWERED_S = 5.0             # a generous bound on "answered at all"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--max-connections", str(CAP),
                        "--max-client-connections", str(PER_CLIENT),
                        "--header-timeout", str(HEADER_TIMEOUT_S), "--event-heartbeat-s", "0.5",
                        log_path=str(log)) as url:
        yield url


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and all(w in error["message"] for w in words), error


def closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_fit_connections_leaves_room_for_the_engines_files():
    assert fit_connections(1024, 20000) == 1024
    small = fit_connections(1024, 1024)                  # a common soft limit that could not be raised
    assert 1 <= small < 1024 and small + room_for(small) <= 1024 - 100
    assert room_for(20) == MIN_ROOM


def test_an_event_streams_kernel_send_buffer_is_fixed_and_other_requests_keep_the_systems():
    """A watcher that never reads would otherwise make Linux grow its connection's send buffer toward 4 MB (240 idle
    streams took 488 MB of kernel memory): the protocol fixes it when a /v1/events request starts, and only then."""
    class Transport:
        def __init__(self) -> None:
            self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)

        def get_extra_info(self, name: str) -> object:
            return self.sock if name == "socket" else None

    def send_buffer_after_request(path: str) -> tuple[int, int]:
        protocol = ConnectionLimitProtocol.__new__(ConnectionLimitProtocol)
        protocol.transport, protocol.scope, protocol._app = Transport(), {"path": path}, "the app"
        sock = protocol.transport.sock
        with sock:
            before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            assert protocol.app == "the app"
            return before, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)

    before, after = send_buffer_after_request("/v1/events")
    assert after in (STREAM_SEND_BUFFER, 2 * STREAM_SEND_BUFFER) and after != before   # (Linux reports it doubled)
    before, after = send_buffer_after_request("/v1/completions")
    assert after == before


def test_stream_limits_count_per_client_and_in_all():
    limits = StreamLimits(per_client=2, total=4)
    alice = [Watcher(), Watcher()]
    for w in alice:
        limits.admit(w, "10.0.0.2", exempt=False)
    with pytest.raises(ServerError) as refused:
        limits.admit(Watcher(), "10.0.0.2", exempt=False)
    assert refused.value.status == 429 and "--max-client-event-streams" in str(refused.value.body())
    limits.admit(Watcher(), "10.0.0.2", exempt=True)     # the key's holder: no per-client bound
    limits.admit(Watcher(), "127.0.0.1", exempt=False)   # this machine: none either
    with pytest.raises(ServerError) as full:
        limits.admit(Watcher(), "10.0.0.3", exempt=False)
    assert full.value.status == 503 and "--max-event-streams" in str(full.value.body())
    limits.release(alice[0])
    limits.release(alice[0])                             # twice is harmless
    limits.admit(Watcher(), "10.0.0.2", exempt=False)    # the place given back is taken again
    assert limits.counts == {"10.0.0.2": 2}


def test_a_full_cap_answers_503_health_still_answers_and_silent_sockets_are_closed(server):
    port = urlsplit(server).port
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.create_connection(("127.0.0.1", port))) for _ in range(SOCKETS)]
        slow = socks[-CAP // 2:]                         # headers a byte at a time: data must not reset the clock
        for sock in slow:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\n")
        assert_openai_error(httpx.get(server + "/v1/models", timeout=ANSWERED_S), 503, "--max-connections")
        health = httpx.get(server + "/health", timeout=ANSWERED_S)
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text

        # Every silent or slow socket is closed once the header timeout passes (some earlier: pushed out by newer
        # connections past the cap's room).
        open_socks = set(socks)
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 15
        while open_socks and time.monotonic() < deadline:
            for sock in slow:
                if sock in open_socks:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X")
            readable, _, _ = select.select(list(open_socks), [], [], 0.3)
            open_socks -= {sock for sock in readable if closed_by_peer(sock)}
        assert not open_socks, f"{len(open_socks)} of {SOCKETS} silent sockets still open after the header timeout"
    assert httpx.get(server + "/v1/models", timeout=ANSWERED_S).status_code == 200   # the cap emptied


def first_answer(sock: socket.socket) -> bytes:
    """What the server wrote to ``sock`` before it closed it (or ANSWERED_S passed)."""
    sock.settimeout(ANSWERED_S)
    data = b""
    with contextlib.suppress(OSError):
        while chunk := sock.recv(4096):
            data += chunk
    return data


def test_one_clients_connections_past_its_cap_get_429_as_they_open_and_take_no_one_elses_place(server):
    """A slowloris from one address: its sockets past --max-client-connections are answered 429 before a byte is
    read, and, not counting among the open connections, leave the --max-connections cap to everyone else."""
    port = urlsplit(server).port
    with contextlib.ExitStack() as stack:
        def connect() -> socket.socket:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.5", 0))
            sock.connect(("127.0.0.1", port))
            return sock
        held = [connect() for _ in range(PER_CLIENT)]
        for sock in held:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")     # headers never finished
        refused = [connect() for _ in range(2 * CAP)]                             # past both caps if they counted
        refused[0].sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        answer = first_answer(refused[0])
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b"retry-after: 1" in head.lower()
        error = json.loads(body)["error"]
        assert error["code"] == 429 and "--max-client-connections" in error["message"], error
        assert all(first_answer(sock).startswith(b"HTTP/1.1 429") for sock in refused[1:])

        # Another student and /health are answered meanwhile (not 503: the refused sockets took no place).
        other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.6"), timeout=ANSWERED_S)
        stack.enter_context(other)
        assert other.get(server + "/v1/models").status_code == 200
        assert httpx.get(server + "/health", timeout=ANSWERED_S).status_code == 200
        for sock in held:
            sock.close()
    # Its places come back once its sockets close.
    deadline = time.monotonic() + ANSWERED_S
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.5"), timeout=ANSWERED_S) as again:
        while (status := again.get(server + "/v1/models").status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert status == 200


def test_a_clients_fifth_event_stream_gets_429_another_clients_works_and_streams_outlive_the_header_timeout(server):
    def student(address: str) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=ANSWERED_S)

    with contextlib.ExitStack() as stack:
        alice, bob = stack.enter_context(student("127.0.0.2")), stack.enter_context(student("127.0.0.3"))

        def open_stream(who: httpx.Client) -> httpx.Response:
            return stack.enter_context(who.stream("GET", server + "/v1/events"))
        tabs = [open_stream(alice) for _ in range(4)]
        assert [tab.status_code for tab in tabs] == [200] * 4
        extra = open_stream(alice)
        extra.read()
        assert_openai_error(extra, 429, "4 event streams", "--max-client-event-streams")
        assert extra.headers.get("retry-after")
        other = open_stream(bob)
        assert other.status_code == 200
        # A stream that got its request in is not cut by the header timeout: it still gets heartbeats after it.
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        assert next(other.iter_bytes())
        # All together they may hold half the connections: this machine (no per-client bound) fills the rest.
        local = httpx.Client(timeout=ANSWERED_S)
        stack.enter_context(local)
        refused = None
        for _ in range(CAP):
            response = open_stream(local)
            if response.status_code != 200:
                refused = response
                break
        assert refused is not None
        refused.read()
        assert_openai_error(refused, 503, "--max-event-streams")
    assert httpx.get(server + "/health", timeout=ANSWERED_S).status_code == 200
