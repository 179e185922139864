"""The servers the guides quote (``serve``, ``classroom``, ``watch --web``, ``fleet``) start as subprocesses, as a
user starts them, answer (``serve``: /health and one real completion through the openai client, with the
command's key), and stop cleanly on Ctrl-C (SIGINT) leaving no process behind; the clients (``watch --attach``,
``bench serve``) run in this process against the README's one ``minipaged serve``. tests/doc_commands.py says
what is substituted (addresses, --threads 1, bench serve's sizes) and what is skipped, and why.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from doc_commands import ALL, Command, failure, first_steps, of_kind, run_main, run_watch_command, student_folder
from minipaged.bench.streams import children
from serve_util import free_port, gone

pytestmark = pytest.mark.slow
START_S = 150.0                 # a SmolLM2 server on a busy 2-core machine: imports, load, its core process
STOP_S = 30.0
CLIENT_S = 120.0
README_SERVE = ["serve", "--threads", "1"]       # README's `minipaged serve`, with the suite's one thread
TRACE = Path(__file__).parent / "data" / "watch_trace.jsonl"
# bench serve's --dataset files, which bench/peer.py and bench/tuning.py write: one {"prompt": ...} a line
DATASETS = ("distinct.jsonl", "shared-prefix.jsonl", "grounded.jsonl")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = student_folder(tmp_path_factory.mktemp("student"))
    shutil.copy(TRACE, folder / "run.jsonl")      # the README's `watch --record run.jsonl` (run in-process in
    for name in DATASETS:                         # test_doc_commands_watch.py) wrote one of these
        (folder / name).write_text("".join(json.dumps({"prompt": f"Question {i}: what is a KV cache block?"}) + "\n"
                                           for i in range(8)))
    return folder


@dataclass
class Started:
    command: Command
    proc: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def fail(self, what: str) -> str:
        return failure(self.command, what, self.output())


def server_argv(command: Command, port: int, server_url: str) -> tuple[list[str], str, str]:
    """The command with the test's addresses: (argv, the URL it answers at, the path that says it is ready)."""
    argv, machines = [], 0
    for word in command.argv:             # fleet --worker-urls gpu1 gpu2: the README's server, spelt two ways
        if word == "{server}":
            word = server_url if machines == 0 else server_url.replace("127.0.0.1", "localhost")
            machines += 1
        argv.append(word)
    url = f"http://127.0.0.1:{port}"
    if argv[0] == "watch":                                       # watch --replay FILE --web
        return argv + ["--web-host", "127.0.0.1", "--web-port", str(port)], url, "/"
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    if argv[0] == "classroom":
        return argv + ["--public-url", url], url, "/"
    if argv[0] == "fleet":                         # ready once its page is up (after the router lists the workers)
        view_port = free_port()
        return argv + ["--view-port", str(view_port)], url, f"http://127.0.0.1:{view_port}/"
    return argv, url, "/health"


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        with contextlib.suppress(OSError):
            for child in children(todo.pop()):
                found.add(child)
                todo.append(child)
    return found


@contextlib.contextmanager
def started(command: Command, folder: Path, server_url: str = ""):
    """Start the command; yield once it is ready; then Ctrl-C (SIGINT to it alone, as a terminal's Ctrl-C reaches
    a foreground process), and check that it ended and that every process it started ended with it. Whatever is
    left is stopped by pid, even when the test failed."""
    port = free_port()
    argv, url, ready = server_argv(command, port, server_url)
    log = folder / f"{argv[0]}-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "minipaged", *argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=folder, env=env, start_new_session=True)
    server = Started(command, proc, url, log)
    ready_url = ready if ready.startswith("http") else url + ready
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + START_S
        while True:
            seen |= descendants(proc.pid)
            assert proc.poll() is None, server.fail(f"exited with {proc.returncode} before answering")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2.0).status_code == 200:
                    break
            assert time.monotonic() < deadline, server.fail(f"did not answer {ready_url} in {START_S:.0f} s")
            time.sleep(0.2)
        yield server
        seen |= descendants(proc.pid)
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(server.fail(f"did not stop within {STOP_S:.0f} s of Ctrl-C (SIGINT)"))
        assert code in (0, 130), server.fail(f"exited with {code} on Ctrl-C")
        end = time.monotonic() + 5
        while (left := [p for p in seen if not gone(p)]) and time.monotonic() < end:
            time.sleep(0.1)
        assert not left, server.fail(f"left processes running after Ctrl-C: {left}")
    finally:
        if proc.poll() is None:               # SIGTERM: the fleet stops what it started on it, as on Ctrl-C
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_S)
        for pid in [proc.pid, *seen]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)


def one_completion(server: Started) -> None:
    """One real completion through the openai client, with the command's --api-key if it has one."""
    import openai
    argv = server.command.argv
    key = argv[argv.index("--api-key") + 1] if "--api-key" in argv else "none"
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, timeout=60, max_retries=0)
    try:
        reply = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                          temperature=0)
    except openai.OpenAIError as exc:
        raise AssertionError(server.fail(f"answered but gave no completion: {exc!r}"))
    assert reply.choices[0].text, server.fail("gave an empty completion")


@pytest.fixture(scope="module")
def readme_server(workdir):
    """The README's ``minipaged serve``, up for the whole module: the clients' server."""
    (command,) = [c for c in ALL if c.argv == README_SERVE]
    with started(command, workdir) as server:
        yield server


@pytest.mark.parametrize("command", of_kind("server"))
def test_servers_answer_and_stop_on_ctrl_c(command, workdir, readme_server):
    if command.argv == README_SERVE:
        one_completion(readme_server)                 # (stopped, and checked, at the module's end)
        return
    with started(command, workdir, readme_server.url) as server:
        if command.argv[0] == "serve":
            one_completion(server)
            if "--open-page" in command.argv:         # students open the page without the key
                page = httpx.get(server.url + "/", timeout=10)
                assert page.status_code == 200 and "<html" in page.text.lower(), server.fail("served no page")
        elif command.argv[0] == "fleet":              # a request through the router reaches a worker
            one_completion(server)


@pytest.mark.parametrize("command", of_kind("client"))
def test_clients_of_the_readme_server_finish(command, workdir, readme_server):
    argv = [w.replace("{server}", readme_server.url) for w in command.argv]
    code, output = run_main(argv, workdir)
    assert code == 0, failure(command, f"exited with {code}", output + "\n--- the server ---\n" +
                              readme_server.output()[-3000:])


def within(seconds: float, app) -> None:
    from doc_commands import engine_alive
    engine_alive(app)
    assert time.monotonic() < app._doc_deadline, f"the app showed no step within {seconds:.0f} s"


@pytest.mark.parametrize("command", of_kind("client-tui"))
def test_watch_attach_draws_a_request_and_quits(command, workdir, readme_server, monkeypatch):
    """The attach app draws; a request sent to the server shows as a step; q quits."""
    stop = threading.Event()

    def send() -> None:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(readme_server.url + "/v1/completions", timeout=60,
                           json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4})

    async def pilot(p):
        p.app._doc_deadline = time.monotonic() + CLIENT_S
        await first_steps(p, check=functools.partial(within, CLIENT_S))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        run_watch_command(Command(command.text, [w.replace("{server}", readme_server.url) for w in command.argv],
                                  command.kind, command.where), workdir, monkeypatch, pilot=pilot)
    finally:
        stop.set()
        sender.join(60)


@pytest.mark.parametrize("command", of_kind("parallel"))
def test_parallel_commands(command):
    """Every parallel command is in SKIPS (its reason names the test that runs the same engine)."""
    raise AssertionError(f"{command} starts worker processes: run it here, or say in SKIPS why not")
