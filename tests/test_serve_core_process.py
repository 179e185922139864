"""``minipaged serve`` runs its engine core in a process of its own (issue 47): the wire between the two carries
the engine's own types unchanged, the core reaches no TCP port, and every way either process can end leaves
nothing behind: a server killed with SIGKILL takes its core with it, a core that dies fails the requests in
flight and stops the server with the cause, and a core that cannot start says why."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import httpx

from minipaged import Engine
from minipaged.bench.streams import children
from minipaged.events import StepEvent
from minipaged.outputs import RequestDelta
from minipaged.request import SamplingParams
from minipaged.serve.core_process import Wire
from tests.serve_util import SUITE_FLAGS, free_port, gone, minipaged_serve_command, server_process

CORE_MODULE = "minipaged.serve.core_process"


def test_the_wire_gives_back_the_engines_own_types(tiny_model, tmp_path):
    """A step's deltas and event, and a request's parameters, cross the wire and come back equal, as the types
    they were (msgspec decodes them against the dataclasses' annotations)."""
    engine = Engine(tiny_model, block_size=4, num_blocks=64)
    params = SamplingParams(max_tokens=4, n=2, logprobs=2, prompt_logprobs=1, temperature=0.8, seed=1,
                            stop=["zz"], logit_bias={3: 0.5})
    engine.add_request([1, 2, 3, 4, 5], params, request_id="r")
    steps = []
    while engine.has_unfinished_requests():
        result = engine.step()
        steps.append((list(result.outputs), result.event))
    api, core = Wire(str(tmp_path), bind=True), Wire(str(tmp_path), bind=False)
    try:
        api.send(("add", "r", [1, 2, 3], params))
        assert core.receive(timeout_s=10) == ("add", "r", [1, 2, 3], params)
        for deltas, event in steps:
            core.send(("step", deltas, event))
        got = [api.receive(timeout_s=10) for _ in steps]
    finally:
        api.close()
        core.close()
    assert got == [("step", deltas, event) for deltas, event in steps]
    assert isinstance(got[-1][2], StepEvent) and isinstance(got[-1][1][0], RequestDelta)
    assert got[-1][1][0].output.outputs[0].logprobs == steps[-1][0][0].output.outputs[0].logprobs


def core_of(server_pid: int) -> int:
    cores = [c for c in children(server_pid) if CORE_MODULE in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(cores) == 1, f"the server's children: {children(server_pid)}"
    return cores[0]


def listening_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":                      # LISTEN
                inodes.add(fields[9])
    return inodes


def socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def stream_until_error(url: str, seen_first: threading.Event, lines: list[str]) -> None:
    body = {"prompt": "a long answer", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: {"):
                    seen_first.set()
    except httpx.HTTPError as exc:
        lines.append(f"(connection: {exc})")
    seen_first.set()


def test_the_core_is_a_process_of_its_own_on_a_private_socket_and_dies_with_a_killed_server(tiny_model, tmp_path):
    """Tensor parallel through the server (the core owns its worker): the same greedy tokens as one engine in
    this process; the wire's sockets are in a private folder; the server killed with SIGKILL leaves neither core
    nor worker."""
    prompt, params = [1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = Engine(tiny_model, block_size=4, num_blocks=64).generate([prompt], params)[0].token_ids
    with server_process(tiny_model, "--tensor-parallel-size", "2", log_path=str(tmp_path / "serve.log")) as (url, proc):
        core = core_of(proc.pid)
        workers = children(core)
        assert workers, "the engine core started no tensor-parallel worker"
        answer = httpx.post(url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}).json()
        assert [int(t.split(":")[1]) for t in answer["choices"][0]["logprobs"]["tokens"]] == expected, answer
        huge = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": prompt, "priority": 2 ** 64})
        assert huge.status_code == 400 and "64 bits" in huge.json()["error"]["message"], huge.text   # msgpack's
        folder = Path(Path(f"/proc/{core}/cmdline").read_text().split("\0")[-2])
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, oct(folder.stat().st_mode)
        assert {p.name for p in folder.iterdir()} >= {"commands", "outputs"}
        seen_first, lines = threading.Event(), []
        threading.Thread(target=stream_until_error, args=(url, seen_first, lines), daemon=True).start()
        assert seen_first.wait(30), lines
        proc.send_signal(signal.SIGKILL)               # no goodbye: the core and its worker must notice
        proc.wait(10)
        deadline = time.monotonic() + 3.0
        while not all(map(gone, [core, *workers])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(core), "the engine core outlived its API server by more than 3 s"
        assert all(map(gone, workers)), "a tensor-parallel worker outlived the server by more than 3 s"


def test_a_core_that_dies_fails_the_requests_in_flight_and_stops_the_server_with_the_cause(tiny_model, tmp_path):
    log = tmp_path / "serve.log"
    with server_process(tiny_model, log_path=str(log)) as (url, proc):
        seen_first, lines = threading.Event(), []
        reader = threading.Thread(target=stream_until_error, args=(url, seen_first, lines), daemon=True)
        reader.start()
        assert seen_first.wait(30), lines
        core = core_of(proc.pid)
        # (with tensor parallelism rank 0 also listens, on 127.0.0.1, for its workers' rendezvous)
        assert not socket_inodes(core) & listening_inodes(), "the engine core listens on a TCP port"
        os.kill(core, signal.SIGKILL)
        reader.join(30)
        assert proc.wait(30) == 1
    errors = [json.loads(line[len("data: "):])["error"] for line in lines if line.startswith('data: {"error"')]
    assert errors and "engine core process was killed by signal 9" in errors[0]["message"], lines[-3:]
    assert "the engine core process was killed by signal 9; stopped" in log.read_text(), log.read_text()[-2000:]


def test_a_core_that_cannot_start_says_why_and_the_server_exits(tiny_model, tmp_path):
    port = free_port()
    done = subprocess.run(minipaged_serve_command(tiny_model, port, [*SUITE_FLAGS, "--num-blocks", "0"]),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the engine core could not start" in done.stderr and "num_blocks must be a positive integer" in \
        done.stderr, done.stderr[-2000:]
    in_thread = subprocess.run(minipaged_serve_command(tiny_model, port, [*SUITE_FLAGS, "--num-blocks", "0",
                                                                          "--core-in-thread"]),
                               capture_output=True, text=True, timeout=120)
    assert in_thread.returncode == 1 and "the engine could not start" in in_thread.stderr, in_thread.stderr[-2000:]
    assert "num_blocks must be a positive integer" in in_thread.stderr, in_thread.stderr[-2000:]
    missing = subprocess.run(minipaged_serve_command(str(tmp_path / "no-such-model"), port, list(SUITE_FLAGS)),
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode in (1, 2) and "no-such-model" in missing.stderr, missing.stderr[-2000:]
