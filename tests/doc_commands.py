"""The ``minipaged ...`` commands the README, docs, lessons and labs quote, as distinct commands to run here, and
what runs them in this process (the test_doc_commands_*.py files share it).

tests/test_doc_commands.py checks that each quoted command *parses*; a class trial showed that is not enough
(``generate -tp 2`` parsed, then failed on SmolLM2's 9 heads), so those files run each distinct command.

What a test machine must change in a command, and only that, is substituted (SUBSTITUTIONS). Commands that are
the same after substitution, or that the CLI parses to the same options (``serve --model smollm2`` is
``serve``), run once. A command this machine cannot run is in SKIPS with its reason, matched by its exact text,
so a skip never hides another command. A failure names the guide's file:line and the command's output tail.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

from test_doc_commands import COMMANDS, ROOT, SHELL_TAIL

SUBSTITUTIONS = """
* a guide's placeholder for a value of the reader's choice: N -> 1, --record/--replay FILE -> run.jsonl,
  --api-key KEY -> doc-key, --model M -> smollm2, --attach/--base-url/--worker-urls URL -> the test's server;
* a lesson's {{...}} numbers, filled as `minipaged lessons N` fills them;
* a server's address: it listens on 127.0.0.1 and a free port (--host/--port/--public-url/--view-port dropped
  from the quoted text, the test's own given), the machines of docs/serving.md (192.168.1.20, gpu1, gpu2) -> the
  test's server (fleet --worker-urls gpu1 gpu2: that server spelt 127.0.0.1 and localhost);
* --threads 1 for every `serve` (one thread per process: the suite's rule for servers);
* `bench serve`: --num-prompts -> 1 (per rate) and --output-len -> at most 8, given or added (the guides' 6 to
  10 requests of up to 768 tokens per rate, or the default 64, are minutes of SmolLM2 on two cores: the README's
  took 96 s); tests/test_bench_serve.py runs bench serve's workloads at their sizes on a tiny model;
* bench serve's --dataset FILE.jsonl, which bench/peer.py and bench/tuning.py write: 8 prompts in its format.
"""
FREE_CHOICE = {"N": "1", "FILE": "run.jsonl", "KEY": "doc-key", "M": "smollm2", "URL": "{server}"}
SERVER_URLS = ("http://127.0.0.1:8000", "http://192.168.1.20:8000", "http://gpu1:8000", "http://gpu2:8000")
SERVER_COMMANDS = ("serve", "classroom", "fleet")
ADDRESS_FLAGS = ("--host", "--port", "--public-url", "--view-port")
BENCH_SERVE_SIZES = {"--num-prompts": 1, "--output-len": 8}

FLEET_SKIP = ("two SmolLM2 replicas and sglang-router: about a minute (tests/test_fleet.py starts the same "
              "command, fleet --replicas 2 --policy cache_aware, on tiny replicas; `fleet --worker-urls` runs here "
              "against the README's server, and test_doc_commands_oneshot.py checks each --serve-args)")
SERVE_SKIP = ("another SmolLM2 server: 25 s here (`minipaged serve` and the README's `serve --api-key KEY "
              "--open-page --hide-others-text` start here; {} on a tiny model)")

# Commands this machine cannot run, by their text as typed (after the shell tail is cut): why.
SKIPS = {
    "minipaged watch --model tinyllama":
        "TinyLlama comes from the Hugging Face hub, which this machine cannot reach (tests/test_api.py checks "
        "the error a user without it gets)",
    # Minutes of CPU on this 2-core machine (measured under load: 90 s and 317 s; watch --no-tui runs the whole
    # default workload, 47 s); tests/test_bench.py runs the same command code on a tiny model.
    "minipaged bench throughput": "a full offline batch on SmolLM2: 90 s of the CI budget (tests/test_bench.py "
                                  "runs the same command on a tiny model)",
    "minipaged bench throughput --baseline transformers":
        "SmolLM2 through minipaged and transformers: 5 minutes (tests/test_bench.py runs the same command on a "
        "tiny model)",
    "minipaged watch --no-tui":
        "prints every step of the whole default workload on SmolLM2: 47 s (tests/test_lessons_pilot.py runs the same "
        "plain printer over a live run, `watch --lesson 1 --no-tui`, on a tiny model; `minipaged watch` runs the "
        "default workload's engine here)",
    # Worker processes, each loading its SmolLM2 shard (measured under load: generate -tp 3 33 s, -pp 2 24 s).
    'minipaged generate -tp 3 "Why is the sky blue?"':
        "three worker processes of SmolLM2 shards: 33 s (tests/test_parallel_smollm2.py builds the same engine, "
        "tensor_parallel_size=3; tests/test_parallel.py runs `minipaged generate -tp 2` on a tiny model; "
        "`minipaged generate` runs here)",
    'minipaged generate -pp 2 "Why is the sky blue?"':
        "two pipeline stages of SmolLM2 in worker processes: 24 s (tests/test_parallel_smollm2.py builds the same "
        "engine, pipeline_parallel_size=2; `minipaged generate` runs here)",
    "minipaged watch -tp 3":
        "the app over three worker processes of SmolLM2 shards (tests/test_parallel_smollm2.py builds the same "
        "engine; `minipaged watch` runs the same app here)",
    # Each a fleet of two SmolLM2 replicas and sglang-router: about a minute each here.
    "minipaged fleet": FLEET_SKIP,
    'minipaged fleet --replicas 2 --policy cache_aware --serve-args "--num-blocks 256"': FLEET_SKIP,
    'minipaged fleet --replicas 2 --policy cache_aware --serve-args "--long-prefill-token-threshold 0 --block-size '
    '16 --num-blocks 48 --max-model-len 512 --num-threads 1"':
        FLEET_SKIP + "; tests/test_lessons.py runs lesson 11's fleet scenario",
    # Another SmolLM2 server each (25 s each here under load, minutes together); `minipaged serve` and the
    # README's teacher `serve --api-key KEY --open-page --hide-others-text` start here.
    "minipaged serve --host 0.0.0.0 --api-key KEY --open-page --page-prompts off --hide-others-text":
        SERVE_SKIP.format("tests/test_serve_teacher.py starts `serve --open-page --page-prompts off "
                          "--hide-others-text`"),
    "minipaged serve --host 0.0.0.0 --api-key KEY --open-page --page-prompt-rate 3 --page-max-tokens 32":
        SERVE_SKIP.format("tests/test_serve_teacher.py starts `serve --page-prompt-rate N --page-max-tokens N`"),
    "minipaged serve --host 0.0.0.0 --api-key KEY --open-page --page-prompt-rate 3 --hide-others-text":
        SERVE_SKIP.format("tests/test_serve_teacher.py starts `serve --page-prompt-rate N` and "
                          "`--hide-others-text`"),
    "minipaged serve --scheduling-policy priority":
        SERVE_SKIP.format("tests/test_serve_priority.py starts `serve --scheduling-policy priority`"),
    "minipaged serve --core-in-thread":
        SERVE_SKIP.format("tests/test_serve_core_process.py starts `serve --core-in-thread`"),
    "minipaged serve --kv-events-config CONFIG":
        SERVE_SKIP.format("tests/test_kv_events.py starts `serve --kv-events-config` with docs/fleet.md's config"),
}
# What the guide says a command does, when that is not "exit 0": (exit status, words the output must hold).
PROMISED = {
    ("watch", "--lesson", "11"): (2, "draws one engine"),     # lesson 11: "so it prints what to run instead"
}


@dataclass
class Command:
    """One distinct command: where the guides quote it, and the argv that runs it here."""
    text: str                                   # as quoted, shell tail cut
    argv: list[str]
    kind: str
    where: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return f"`{self.text}` (quoted at {', '.join(self.where)})"

    @property
    def skip(self) -> str | None:
        return SKIPS.get(self.text)


def lesson_values(where: str, text: str) -> str:
    """A lesson's ``{{...}}`` filled as ``minipaged lessons N`` fills them."""
    if "{{" not in text or not where.startswith("lessons/lesson"):
        return text
    from minipaged.lessons.core import fill, list_lessons
    path = ROOT / where.rsplit(":", 1)[0]
    (lesson,) = [lesson for lesson in list_lessons() if lesson.markdown_path.resolve() == path.resolve()]
    return fill(text, lesson.measured, lesson.scenario.engine_options(), lesson.smollm2)


def to_argv(text: str) -> list[str]:
    """The words to run: placeholders a reader fills in, what a test machine must change (SUBSTITUTIONS)."""
    words = shlex.split(re.sub(r"\s\.\.\.(?=\s|$)", "", text))[1:]
    out: list[str] = []
    for i, word in enumerate(words):
        before = words[i - 1] if i else ""
        if word in FREE_CHOICE and (before.startswith("--") or word == "N"):
            word = FREE_CHOICE[word]
        if word in SERVER_URLS:
            word = "{server}"
        if before in BENCH_SERVE_SIZES and words[:2] == ["bench", "serve"]:
            word = str(min(int(word), BENCH_SERVE_SIZES[before]))
        out.append(word)
    if out[:2] == ["bench", "serve"] and len(out) > 2:           # (not the name alone, in a sentence)
        out += [w for flag, size in BENCH_SERVE_SIZES.items() if flag not in out for w in (flag, str(size))]
    if out and out[0] in SERVER_COMMANDS and "--help" not in out:
        out = without_address(out)
        if out[0] == "serve" and "--threads" not in out:
            out += ["--threads", "1"]
    return out


def without_address(argv: list[str]) -> list[str]:
    """A server's address flags: the test gives its own (127.0.0.1, free ports)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in ADDRESS_FLAGS:
            skip = True
        else:
            out.append(word)
    return out


@functools.lru_cache(maxsize=None)
def the_parser():
    from minipaged.cli import make_parser
    return make_parser()


def parsed(argv: list[str]):
    """What the CLI makes of ``argv``: its options (a Namespace), ``"--help"`` for a command that ends at parsing,
    or None for a subcommand's name in a sentence (``minipaged bench serve``)."""
    from test_doc_commands import subcommand_path
    parser = the_parser()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv)
        except SystemExit as exit_:
            if subcommand_path(parser, argv):
                return None
            # --help ends at parsing; a command the parser refuses runs as a one-shot, and fails with its error
            # (tests/test_doc_commands.py names it too)
            return "--help" if exit_.code == 0 else "refused"


def distinct_commands() -> list[Command]:
    """Two commands with the same options are one command (``serve --model smollm2`` is ``serve``)."""
    by_options: dict[tuple, Command] = {}
    for where, quoted in COMMANDS:
        text = " ".join(SHELL_TAIL.sub("", quoted).split())
        if ".md.in:" in where:
            continue                              # rendered into docs/X.md, whose own quote runs
        text = lesson_values(where, text)
        argv = to_argv(text)
        args = parsed(argv) if argv else None
        if args is None:
            continue
        options = (args, *argv) if isinstance(args, str) else tuple(sorted((k, repr(v)) for k, v in vars(args).items()))
        command = by_options.setdefault(options, Command(text, argv, kind=kind(argv, args)))
        command.where.append(where)
    return list(by_options.values())


def kind(argv: list[str], args) -> str:
    """How a command ends: 'oneshot' (runs to its end here), 'tui' (the watch app, driven by the pilot),
    'client' / 'client-tui' (needs the README's server), 'server' (runs until stopped), 'parallel' (starts
    worker processes)."""
    if args == "refused":
        return "oneshot"
    if args != "--help" and (getattr(args, "tensor_parallel_size", 1) or 1) * \
            (getattr(args, "pipeline_parallel_size", 1) or 1) > 1:
        return "parallel"
    if argv[0] == "watch":
        if "--web" in argv:
            return "server"
        if "--attach" in argv:
            return "client-tui"
        return "tui" if "--no-tui" not in argv else "oneshot"
    if argv[0] in SERVER_COMMANDS and args != "--help":
        return "server"
    if "{server}" in argv:
        return "client"
    return "oneshot"


ALL = distinct_commands()


def of_kind(*kinds: str, where=lambda c: True) -> list:
    """pytest params for the commands of these kinds; a skipped one carries its reason."""
    return [pytest.param(c, id=" ".join(c.argv)[:90],
                         marks=[pytest.mark.skip(reason=c.skip)] if c.skip else [])
            for c in ALL if c.kind in kinds and where(c)]


def failure(command: Command, what: str, output: str) -> str:
    tail = "\n".join(output.strip().splitlines()[-25:])
    return f"{command} {what}\n--- its output (tail) ---\n{tail}"


# ------------------------------------------------------------------------------------------ the folders

def student_folder(folder: Path) -> Path:
    """The student's folder: the guide's my_policy.py (docs/policies.md), and nothing else yet."""
    policies = (ROOT / "docs" / "policies.md").read_text()
    (code,) = [block for block in re.findall(r"```python\n(.*?)```", policies, re.S) if "# my_policy.py" in block]
    (folder / "my_policy.py").write_text(code)
    return folder


def lab_folder(folder: Path) -> Path:
    """A student's folder after the labs' step "fill in the TODOs": each lab file written from its stub alone
    (tests/test_labs.py's filled_stub), for ``watch --lab N`` (which runs the student's code)."""
    from minipaged.lessons.labs import all_labs
    from test_labs import filled_stub
    for lab in all_labs():
        (folder / lab.file_name).write_text(filled_stub(lab.number))
    return folder


@contextlib.contextmanager
def inside(folder: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(before)


def run_main(argv: list[str], folder: Path) -> tuple[int, str]:
    """``minipaged ARGV`` in this process, in ``folder``: (exit status, what it printed)."""
    from minipaged.cli import main
    out = io.StringIO()
    with inside(folder), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        finally:
            # as the console command does at exit (cli.entry_point): a parallel engine's worker processes go,
            # and this process may start another (torch.distributed has one default group per process)
            parallel = sys.modules.get("minipaged.parallel.distributed_runner")
            if parallel is not None:
                parallel.close_all()
    return code, out.getvalue()


def expected_end(command: Command, code: int, output: str) -> None:
    """Exit 0, or what the guide promises: ``lab check N`` on the untouched stub fails each check with "not
    written yet" (each lab guide's step 1)."""
    if command.argv[:2] == ["lab", "check"]:
        assert code == 1 and "0 of" in output and "not written yet" in output, failure(
            command, f"on the untouched stub should fail every check with 'not written yet' (exit {code})", output)
        return
    want, words = PROMISED.get(tuple(command.argv), (0, ""))
    assert code == want and words in output, failure(command, f"exited with {code}, not {want} as its guide says",
                                                     output)


# ------------------------------------------------------------------------------------------ the model, once

KEPT: dict[tuple, tuple[Any, list]] = {}       # (model, dtype, device) -> (its first load, its tensors' data)


@contextlib.contextmanager
def one_load_per_model(monkeypatch) -> Iterator[None]:
    """Each engine these commands build loads its model through ``engine_builder.load_model``; here the first
    load of a model is kept and handed to every later engine, its parameters pointed back at the tensors the load
    gave them. Sharing is safe because nothing writes a weight: an engine takes copies (stacked q|k|v and gate|up,
    then ``store_weights_for`` copies each into its own buffer and points transformers' module at that copy, of
    the same values), and quantizing replaces the engine's own tensors. So every engine computes with exactly the
    weights a fresh load gives; only the seconds of reading them again are saved. (Only these files' commands
    get it: the patch ends with the caller's ``monkeypatch``.)"""
    from minipaged import engine_builder
    real = engine_builder.load_model

    def load_model(model: str, *, dtype, device: str = "cpu", progress=None):
        key = (model, str(dtype), device)
        if key not in KEPT:
            loaded = real(model, dtype=dtype, device=device, progress=progress)
            KEPT[key] = loaded, [(t, t.data) for t in [*loaded.hf_model.parameters(), *loaded.hf_model.buffers()]]
        loaded, originals = KEPT[key]
        for tensor, data in originals:
            tensor.data = data
        return dataclasses.replace(loaded)
    monkeypatch.setattr(engine_builder, "load_model", load_model)
    try:
        yield
    finally:
        for _loaded, originals in KEPT.values():       # the last engine's buffers can go
            for tensor, data in originals:
                tensor.data = data


# ------------------------------------------------------------------------------------------ the watch app

FIRST_STEPS = 1
# Apps whose first step is not waited for (the app draws and its engine loads with the command's options, then q):
STEPS_NOT_WAITED = {
    "minipaged watch --lesson 12":
        "its first step prefills all 128 streams (about 3,000 tokens of SmolLM2 on one thread: 45 s here); "
        "tests/test_lessons.py runs lesson 12's scenario to its end on a tiny model",
}
POLL_S = 0.05
THREAD_JOIN_S = 30.0
APP_SIZE = (140, 42)


def engine_alive(app) -> None:
    """Fail at once if the app shows an engine error or its engine worker ended (it would never step)."""
    assert not app.engine_error, f"the app shows an engine error: {app.engine_error}"
    from textual.worker import WorkerState
    ended = [w for w in app.workers if w.name == "engine" and w.state in (WorkerState.ERROR, WorkerState.CANCELLED)]
    assert not ended, f"the engine worker ended: {ended[0].state.name} {ended[0].error!r}"


async def first_steps(pilot, check=engine_alive, steps: int = FIRST_STEPS) -> None:
    """What a student sees first: the app draws, the engine loads, its first step runs (a paused app, as a
    lesson starts, is stepped with n), then q quits. It waits for what the app shows, never for a time: on a
    busy machine it takes longer, and finds the same."""
    app = pilot.app
    while app.state is None:
        check(app)
        await pilot.pause(POLL_S)
    first = app.position
    while app.position < first + steps and not (app.engine_done and app.position == len(app.events)):
        check(app)
        if app.paused and not app.engine_busy and not app.queued_steps:
            await pilot.press("n")
        await pilot.pause(POLL_S)
    assert app.position >= first + steps or app.engine_done, "no step was shown"
    assert app.screen.query("#topbar"), "the app drew nothing"
    check(app)
    await pilot.press("q")


@contextlib.contextmanager
def apps_driven_headless(monkeypatch, pilot=first_steps) -> Iterator[None]:
    """``App.run`` (what the CLI calls) runs with Textual's headless driver (no terminal) and ``pilot`` at the
    keys; the CLI's own code around it (``_run_app``: waiting for the step in flight, the engine's error) runs
    as it does for a user."""
    from textual.app import App
    real_run = App.run

    def run(self, *args, **kwargs):
        return real_run(self, headless=True, size=APP_SIZE, auto_pilot=pilot)
    monkeypatch.setattr(App, "run", run)
    yield


def our_threads() -> set:
    import threading
    return {t for t in threading.enumerate() if t.is_alive() and t.name not in ("tqdm_monitor",)}


def run_watch_command(command: Command, folder: Path, monkeypatch, pilot=None) -> str:
    """Run a ``watch`` command with its app driven by ``pilot`` (its first step, unless STEPS_NOT_WAITED); it must
    end as its guide says and leave no thread of ours running."""
    if pilot is None:
        pilot = functools.partial(first_steps, steps=0 if command.text in STEPS_NOT_WAITED else FIRST_STEPS)
    before = our_threads()
    with apps_driven_headless(monkeypatch, pilot):
        try:
            code, output = run_main(command.argv, folder)
        except AssertionError as exc:                  # the pilot's: which command, and where it is quoted
            raise AssertionError(f"{command}: {exc}") from None
    expected_end(command, code, output)
    for thread in our_threads() - before:
        thread.join(THREAD_JOIN_S)
    left = [t.name for t in our_threads() - before]
    assert not left, failure(command, f"left threads running after q: {left}", output)
    return output
