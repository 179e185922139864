"""What a lesson is made of, and the headless runner that measures its numbers.

A lesson is two files side by side in ``lessons/``:

* ``lessonN_slug.md``: the text. Numbers in it are placeholders, ``{{measured.hit_rate:.0%}}`` (a value
  measured by running the scenario, with an optional Python format spec) or ``{{config.num_blocks}}`` (an
  engine option of the scenario), so no number in a lesson is written by hand.
* ``lessonN_slug.py``: the scenario (engine options + who arrives when with which prompt), its variants
  (the same workload under other options, e.g. ``policy="static"``), ``measure(runs)`` (the numbers the text
  quotes, computed from StepEvents alone), the checkpoints (predicates over the learner's stream of
  StepEvents) and the quiz.

Prompts are given as token ids cut to exact lengths, and every request uses greedy decoding with
``ignore_eos=True`` and a fixed ``max_tokens``: what the scheduler does (blocks, hits, chunks, preemptions)
then depends only on lengths and shared prefixes, never on the model's weights, so a tiny random model in
the tests and SmolLM2 in the TUI produce the same numbers. The token ids come from real English text run
through the model's own tokenizer, so SmolLM2 has something sensible to continue.

``measured.json`` holds the values of the last headless run; ``python -m minipaged.lessons --update``
rewrites it and a test checks that a fresh run still gives the same values.
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from minipaged import placeholders
from minipaged.event_view import EngineView
from minipaged.events import EngineInfo, StepEvent
from minipaged.request import SamplingParams

HERE = Path(__file__).resolve().parent
MEASURED_FILE = HERE / "measured.json"
# Numbers that depend on the model's weights (how often a draft is right, wall-clock speed-ups) cannot come
# from the tiny test model: ``bench/spec_decode.py`` measures them on SmolLM2 and writes them here.
SMOLLM2_FILE = HERE / "measured_smollm2.json"

# --------------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Text:
    """A piece of prompt: ``source`` run through the model's tokenizer, repeated or cut to ``num_tokens``."""

    source: str
    num_tokens: int

    def token_ids(self, tokenizer: Any) -> list[int]:
        ids = list(tokenizer(self.source, add_special_tokens=False).input_ids)
        if not ids:
            raise ValueError(f"the text {self.source[:30]!r} tokenizes to nothing")
        sep = list(tokenizer(" ", add_special_tokens=False).input_ids)
        out = list(ids)
        while len(out) < self.num_tokens:
            out += sep + ids
        return out[:self.num_tokens]


@dataclass(frozen=True)
class OneTokenChanged(Text):
    """``Text(source, num_tokens)`` with the token at ``position`` replaced by the first token of ``word``: a
    prompt that differs from the other in exactly one token (the date in a system prompt, a name)."""

    position: int = 0
    word: str = ""

    def token_ids(self, tokenizer: Any) -> list[int]:
        ids = super().token_ids(tokenizer)
        new = list(tokenizer(self.word, add_special_tokens=False).input_ids)[:1]
        if not new or new[0] == ids[self.position]:
            raise ValueError(f"{self.word!r} does not change token {self.position} of {self.source[:30]!r}")
        return ids[:self.position] + new + ids[self.position + 1:]


@dataclass(frozen=True)
class RequestSpec:
    """One request of a scenario: added just before engine step ``step`` (1 is the first step)."""

    request_id: str
    step: int
    prompt: tuple[Text, ...]
    max_tokens: int
    priority: int = 0                  # --scheduling-policy priority: lower goes first (lesson 8)
    client: Optional[str] = None       # who sent it, for --fair-share (lesson 8); None: the one anonymous client

    @property
    def prompt_len(self) -> int:
        return sum(p.num_tokens for p in self.prompt)

    @property
    def params(self) -> SamplingParams:
        # Greedy and ignore_eos: every request generates exactly max_tokens tokens on any model.
        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True, priority=self.priority,
                              client=self.client)

    def token_ids(self, tokenizer: Any) -> list[int]:
        return [t for piece in self.prompt for t in piece.token_ids(tokenizer)]


def request(request_id: str, step: int, *prompt: Text, max_tokens: int, priority: int = 0,
            client: Optional[str] = None) -> RequestSpec:
    return RequestSpec(request_id, step, tuple(prompt), max_tokens, priority, client)


# Each lesson shows one mechanism: the cap on a long prompt's chunk (issue 39, on by default on a CPU) stays off
# unless a lesson's own options turn it on, so lesson 4's budgets alone decide its chunks.
LESSON_DEFAULTS: dict[str, Any] = {"long_prefill_token_threshold": 0}
# Options that change how fast a step runs but not what it schedules, caches or preempts: a run that sets them
# is still the lesson's variant (a class trial's --num-threads 4 was told its numbers "may differ"; they did not).
NOT_SHOWN_OPTIONS = frozenset({"num_threads"})


@dataclass(frozen=True)
class Scenario:
    """A workload plus the engine options that make one mechanism visible.

    ``variants`` maps a name to option overrides; the first one is the run ``minipaged watch --lesson N``
    opens, the others are what the lesson compares it with (the text says which flag opens them).
    """

    options: dict[str, Any]
    requests: tuple[RequestSpec, ...]
    variants: dict[str, dict[str, Any]] = field(default_factory=lambda: {"main": {}})

    @property
    def main_variant(self) -> str:
        return next(iter(self.variants))

    def engine_options(self, variant: Optional[str] = None) -> dict[str, Any]:
        variant = variant or self.main_variant
        if variant not in self.variants:
            raise KeyError(f"no variant {variant!r}; choose one of {list(self.variants)}")
        return {**LESSON_DEFAULTS, **self.options, **self.variants[variant]}

    def request(self, request_id: str) -> RequestSpec:
        return next(r for r in self.requests if r.request_id == request_id)

    def run_headless(self, model: str, variant: Optional[str] = None) -> "Run":
        """One variant on one in-process engine (a fleet lesson's scenario runs replicas instead: fleet.py)."""
        return run_variant(self, model, variant)

    def watch_elsewhere(self, number: int) -> Optional[str]:
        """None: ``minipaged watch --lesson N`` draws this scenario (a fleet lesson's says what to run instead)."""
        return None

    def variant_command(self, number: int, variant: str) -> Optional[str]:
        """None: ``minipaged watch`` with the variant's flags opens it (a served lesson's variant is a server)."""
        return None


class ScenarioFeed:
    """Adds a scenario's requests to an engine when their step comes.

    The rule is the TUI's (``minipaged.tui.driver.LiveRun``): arrival steps count engine steps, and when the
    engine falls idle before the next arrival the gap is skipped, so headless runs and live runs see the
    same steps.
    """

    def __init__(self, scenario: Scenario, tokenizer: Any) -> None:
        self.pending = deque(sorted(scenario.requests, key=lambda r: r.step))
        self.tokenizer = tokenizer
        self.offset = 0

    def add_due(self, engine: Any, steps_done: int) -> None:
        step = steps_done + 1
        if self.pending and not engine.has_unfinished_requests():
            self.offset = max(self.offset, self.pending[0].step - step)
        while self.pending and self.pending[0].step <= step + self.offset:
            spec = self.pending.popleft()
            engine.add_request(spec.token_ids(self.tokenizer), spec.params, request_id=spec.request_id)

    @property
    def done(self) -> bool:
        return not self.pending


# --------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    """Everything one headless run produced: the engine's header and its StepEvents, nothing else."""

    variant: str
    info: EngineInfo
    events: list[StepEvent]

    # The numbers below are computed from events alone, like everything an observer shows.
    @property
    def num_steps(self) -> int:
        return len(self.events)

    @property
    def outputs(self) -> dict[str, list[int]]:
        """Generated token ids per request, in order."""
        out: dict[str, list[int]] = {}
        for ev in self.events:
            for rid, toks in ev.new_token_ids.items():
                out.setdefault(rid, []).extend(toks)
        return out

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for ev in self.events for t in ev.new_token_ids.values())

    @property
    def prefill_tokens(self) -> int:
        """Tokens whose KV was computed by prefill (prompts, their chunks, and recomputes)."""
        return sum(ev.num_prefill_tokens for ev in self.events)

    @property
    def num_preemptions(self) -> int:
        return sum(len(ev.preempted) for ev in self.events)

    def preemptions(self, mode: str) -> int:
        return sum(1 for ev in self.events for p in ev.preempted if p.mode == mode)

    @property
    def blocks_swapped(self) -> int:
        """Blocks copied GPU -> CPU and back."""
        return sum(len(pairs) for ev in self.events for d in (ev.kv.swapped_out, ev.kv.swapped_in)
                   for pairs in d.values())

    def arrival_step(self, request_id: str) -> int:
        return next(ev.step for ev in self.events if any(a.request_id == request_id for a in ev.arrivals))

    def token_steps(self, request_id: str) -> list[int]:
        """The steps in which the request got a generated token."""
        return [ev.step for ev in self.events if request_id in ev.new_token_ids]

    def first_scheduled_step(self, request_id: str) -> int:
        return next(ev.step for ev in self.events if any(s.request_id == request_id for s in ev.scheduled))

    def finish_step(self, request_id: str) -> int:
        return next(ev.step for ev in self.events if any(f.request_id == request_id for f in ev.finished))

    def event(self, step: int) -> StepEvent:
        return self.events[step - 1]

    def views(self) -> Iterable[tuple[StepEvent, EngineView]]:
        """(event, view after it) for every step; the view object is reused, so read it inside the loop."""
        view = EngineView(self.info)
        for ev in self.events:
            view.apply(ev)
            yield ev, view


def run_variant(scenario: Scenario, model: str, variant: Optional[str] = None, *,
                max_steps: int = 5000, **extra_options: Any) -> Run:
    """Run one variant of a scenario headless on ``model`` (a model name or local folder) to the end."""
    from minipaged.engine import Engine

    variant = variant or scenario.main_variant
    engine = Engine(model, **{**scenario.engine_options(variant), **extra_options})
    with engine:                       # a parallel variant's worker processes stop when the run ends
        feed = ScenarioFeed(scenario, engine.tokenizer)
        events: list[StepEvent] = []
        while True:
            feed.add_due(engine, len(events))
            if not engine.has_unfinished_requests():
                break
            events.append(engine.step().event)
            if len(events) > max_steps:
                raise RuntimeError(f"the scenario did not finish in {max_steps} steps")
    return Run(variant, engine.info, events)


def build_lesson_model(folder: str) -> str:
    """The tiny random Llama the lessons are measured on (and tested with): SmolLM2's head layout, 9 query
    heads over 3 KV heads, so every parallel layout SmolLM2 allows (tensor parallel 1 or 3) runs on it too.
    Scheduling numbers do not depend on the model's size, so it gives SmolLM2's numbers in seconds."""
    from minipaged.model.testing import build_tiny_llama

    return str(build_tiny_llama(folder, hidden_size=72, num_heads=9, num_kv_heads=3, intermediate_size=144))


# --------------------------------------------------------------------------------------------- checkpoints


class Trace:
    """What a checkpoint sees: the learner's run so far, folded from StepEvents.

    ``last`` is the newest event, ``view`` the EngineView after it, ``before`` each request's state before it
    (``waiting``/``running``/``swapped``/``finished``, or missing for a request that had not arrived).
    """

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.view = EngineView(info)
        self.events: list[StepEvent] = []
        self.before: dict[str, str] = {}
        self.before_owners: list[list[str]] = [[] for _ in range(info.num_blocks)]

    @property
    def last(self) -> StepEvent:
        return self.events[-1]

    def apply(self, event: StepEvent) -> None:
        self.before = {rid: r.state for rid, r in self.view.requests.items()}
        self.before_owners = [list(o) for o in self.view.block_owners]
        self.view.apply(event)
        self.events.append(event)

    def admitted(self) -> list[str]:
        """Requests that went from waiting (or not yet arrived) to running in the last step."""
        return [s.request_id for s in self.last.scheduled
                if self.before.get(s.request_id, "waiting") == "waiting"]

    def blocks(self, request_id: str) -> list[int]:
        req = self.view.requests.get(request_id)
        return list(req.blocks) if req else []

    def finished(self, request_id: str) -> bool:
        req = self.view.requests.get(request_id)
        return req is not None and req.state == "finished"

    def all_complete(self, scenario: "Scenario") -> Optional[bool]:
        """None while any of the scenario's requests is missing or unfinished; then whether every one got all
        the tokens it asked for (a preempted request must still get them all)."""
        requests = self.view.requests.values()
        if len(requests) < len(scenario.requests) or any(r.state != "finished" for r in requests):
            return None
        return all(r.num_output_tokens == r.max_tokens for r in requests)


# A check returns a truthy value when the learner's run shows the thing; a string is shown as the detail.
Check = Callable[[Trace], Union[bool, str, None]]


@dataclass(frozen=True)
class Checkpoint:
    text: str                          # what the learner should see, e.g. "r2 is admitted with cached blocks"
    check: Check
    hint: str = ""                     # what to do to see it: "press n until r2 is admitted"
    variants: Optional[tuple[str, ...]] = None   # runs in which it can happen (None: any run)


def decodes(ev: StepEvent) -> int:
    """How many requests decoded in this step, or 0 when the step did anything else (a prefill, a chunk)."""
    kinds = {s.kind for s in ev.scheduled}
    return len(ev.scheduled) if kinds == {"decode"} else 0


def decode_steps(events: list[StepEvent], batch: int) -> list[StepEvent]:
    """The steps in which exactly ``batch`` requests decoded and nothing else ran (lessons 9 and 10 time them)."""
    return [ev for ev in events if decodes(ev) == batch]


def every_request_finished(scenario: "Scenario") -> Checkpoint:
    """The closing checkpoint several lessons share: every request of ``scenario`` finished with all its tokens."""
    def check(t: Trace) -> Any:
        return t.all_complete(scenario) and f"your run: {len(t.events)} steps, every request got all its tokens"
    return Checkpoint("every request finished with all its tokens", check, "let the run finish")


@dataclass(frozen=True)
class QuizQuestion:
    question: str
    choices: tuple[str, ...]
    answer: int                        # index into choices
    explanation: str


class CheckpointTracker:
    """Feeds StepEvents to a lesson's checkpoints; a checkpoint stays ticked once the run has shown it.

    Events are identified by their step number, so stepping back and forward again in the TUI (which shows
    the same events a second time) does not count twice.
    """

    def __init__(self, lesson: "Lesson", info: EngineInfo) -> None:
        self.lesson = lesson
        self.info = info
        self.trace = Trace(info)
        self.variant = lesson.detect_variant(info)
        self.ticked: dict[int, tuple[int, str]] = {}     # checkpoint index -> (step, detail)

    def active(self, index: int) -> bool:
        cp = self.lesson.checkpoints[index]
        return cp.variants is None or self.variant in cp.variants

    def feed(self, event: StepEvent) -> list[int]:
        """Apply one event; returns the indices of checkpoints that ticked on it."""
        if self.trace.events and event.step <= self.trace.last.step:
            return []                                      # an event shown again after stepping back
        self.trace.apply(event)
        new = []
        for i, cp in enumerate(self.lesson.checkpoints):
            if i in self.ticked or not self.active(i):
                continue
            result = cp.check(self.trace)
            if result:
                self.ticked[i] = (event.step, result if isinstance(result, str) else "")
                new.append(i)
        return new

    @property
    def num_active(self) -> int:
        return sum(1 for i in range(len(self.lesson.checkpoints)) if self.active(i))

    @property
    def next_index(self) -> Optional[int]:
        """The first active checkpoint not yet ticked (the one the panel points at)."""
        return next((i for i in range(len(self.lesson.checkpoints)) if self.active(i) and i not in self.ticked),
                    None)


# --------------------------------------------------------------------------------------------- lessons

# A repository folder that lessons link into -> the package it is installed as.
SOURCE_PACKAGES = {"minipaged": "minipaged", "kernels": "minipaged.kernels", "tui": "minipaged.tui",
                   "lessons": "minipaged.lessons"}

def fill(template: str, measured: dict[str, Any], options: dict[str, Any],
         smollm2: Optional[dict[str, Any]] = None) -> str:
    """Replace ``{{measured.key:fmt}}``, ``{{config.key:fmt}}`` and ``{{smollm2.key:fmt}}`` (the docs' renderer
    fills its templates the same way, ``minipaged.placeholders``); an unknown key raises KeyError."""
    return placeholders.fill(template, {"measured": measured, "config": options, "smollm2": smollm2 or {}})


@dataclass
class Lesson:
    number: int
    title: str
    slug: str                          # file stem: lessonN_slug
    template: str                      # the markdown with placeholders
    scenario: Scenario
    checkpoints: tuple[Checkpoint, ...]
    quiz: tuple[QuizQuestion, ...]
    measure: Callable[[dict[str, Run]], dict[str, Any]]
    summary: str = ""
    # Numbers that depend on the machine or the model (milliseconds, acceptance rates): measured on SmolLM2
    # by ``python -m minipaged.lessons --measure-smollm2`` into measured_smollm2.json, never by the tests.
    measure_smollm2: Optional[Callable[[dict[str, Run]], dict[str, Any]]] = None
    # The model measure_smollm2's runs use: "smollm2", or "tiny" (the lessons' tiny model) for a lesson about a
    # cheap forward pass (lesson 12: the host's share of a step, as on a fast GPU).
    timed_on: str = "smollm2"
    measured: dict[str, Any] = field(default_factory=dict)   # from measured.json (the last headless run)
    smollm2: dict[str, Any] = field(default_factory=dict)    # from measured_smollm2.json (a benchmark's run)

    @property
    def markdown_path(self) -> Path:
        return HERE / f"{self.slug}.md"

    @property
    def markdown(self) -> str:
        """The lesson text with every placeholder filled from ``measured.json``."""
        return self.render(self.measured)

    def render(self, measured: dict[str, Any]) -> str:
        return fill(self.template, measured, self.scenario.engine_options(), self.smollm2)

    def render_quiz(self, measured: Optional[dict[str, Any]] = None) -> list[QuizQuestion]:
        values, options = self.measured if measured is None else measured, self.scenario.engine_options()

        def text(t: str) -> str:
            return fill(t, values, options, self.smollm2)
        return [QuizQuestion(text(q.question), tuple(text(c) for c in q.choices), q.answer, text(q.explanation))
                for q in self.quiz]

    def asks_quiz(self, variant: Optional[str]) -> bool:
        """The quiz belongs to the lesson, not to a run: it is asked in the main run (and in a run with the
        learner's own options), so opening the other variants does not ask the same questions again."""
        return variant is None or variant == self.scenario.main_variant

    def render_checkpoint(self, index: int) -> tuple[str, str]:
        cp, options = self.checkpoints[index], self.scenario.engine_options()
        return fill(cp.text, self.measured, options, self.smollm2), fill(cp.hint, self.measured, options,
                                                                         self.smollm2)

    def detect_variant(self, info: EngineInfo) -> Optional[str]:
        """Which of the scenario's variants a run is, judged by its EngineInfo (None: options were changed)."""
        from minipaged.config import EngineConfig
        from minipaged.spec_decode.config import SpeculativeConfig

        defaults = EngineConfig()
        keys = {k for name in self.scenario.variants for k in self.scenario.engine_options(name)} - NOT_SHOWN_OPTIONS
        for name in self.scenario.variants:
            options = {k: self.scenario.engine_options(name).get(k, getattr(defaults, k)) for k in keys}
            if options.get("speculative_config") is not None:   # as the engine reports it: defaults filled in
                options["speculative_config"] = SpeculativeConfig.parse(options["speculative_config"]).as_dict()
            if info.preemption_mode != "swap":
                options.pop("num_cpu_blocks", None)      # the engine reports 0 CPU blocks without swap
            if "fair_share" in options:                  # None (the library's default) runs as False
                options["fair_share"] = bool(options["fair_share"])
            if all(getattr(info, k) == v for k, v in options.items() if hasattr(info, k)):
                return name
        return None

    def options_for(self, user_options: dict[str, Any]) -> tuple[Optional[str], dict[str, Any]]:
        """The engine options for a live run: the variant that the user's own flags point at (or the main
        one), with those flags on top. ``--policy static`` opens the static variant of lesson 2, say."""
        best, best_score = self.scenario.main_variant, 0
        for name in self.scenario.variants:
            options = self.scenario.engine_options(name)
            score = sum(1 for k, v in user_options.items() if k in self.scenario.variants[name] and options[k] == v)
            if score > best_score:
                best, best_score = name, score
        from minipaged.config import suggestions_left
        options = {**suggestions_left(self.scenario.engine_options(best), user_options), **user_options}
        shown = [{k: v for k, v in o.items() if k not in NOT_SHOWN_OPTIONS}
                 for o in (options, self.scenario.engine_options(best))]
        return (best if shown[0] == shown[1] else None), options

    def variant_command(self, name: str) -> str:
        """The command that opens a variant: its first option override as a ``minipaged watch`` flag."""
        from minipaged.options import as_command_line

        if (command := getattr(self.scenario, "variant_command", lambda n, v: None)(self.number, name)) is not None:
            return command
        first = dict(list(self.scenario.variants[name].items())[:1])
        return " ".join(["minipaged watch --lesson", str(self.number), *as_command_line(first)])

    def tracker(self, info: EngineInfo) -> CheckpointTracker:
        return CheckpointTracker(self, info)

    @staticmethod
    def source_path(link: str) -> Path:
        """Where a link in a lesson (``../minipaged/scheduler.py``, written for the repository's layout)
        points in this installation: the repository's top-level folders are installed as ``minipaged.*``
        packages, so the first folder of the link is looked up as a package."""
        parts = Path(link).parts
        parts = parts[1:] if parts and parts[0] == ".." else parts
        if not parts or parts[0] not in SOURCE_PACKAGES:
            return (HERE / link).resolve()
        package = importlib.import_module(SOURCE_PACKAGES[parts[0]])
        return Path(package.__file__).resolve().parent.joinpath(*parts[1:])


def _lesson_modules() -> list[str]:
    names = [m.name for m in pkgutil.iter_modules([str(HERE)]) if re.fullmatch(r"lesson\d+_\w+", m.name)]
    return sorted(names, key=lambda n: int(re.match(r"lesson(\d+)", n).group(1)))


def load_measured() -> dict[str, dict[str, Any]]:
    if not MEASURED_FILE.exists():
        return {}
    return json.loads(MEASURED_FILE.read_text(encoding="utf-8"))


def load_smollm2() -> dict[str, dict[str, Any]]:
    if not SMOLLM2_FILE.exists():
        return {}
    return json.loads(SMOLLM2_FILE.read_text(encoding="utf-8"))


def _build(module_name: str, measured: dict[str, dict[str, Any]]) -> Lesson:
    mod = importlib.import_module(f"{__package__}.{module_name}")
    return Lesson(number=mod.NUMBER, title=mod.TITLE, slug=module_name,
                  template=(HERE / f"{module_name}.md").read_text(encoding="utf-8"),
                  scenario=mod.SCENARIO, checkpoints=tuple(mod.CHECKPOINTS), quiz=tuple(mod.QUIZ),
                  measure=mod.measure, summary=getattr(mod, "SUMMARY", ""),
                  measure_smollm2=getattr(mod, "measure_smollm2", None), timed_on=getattr(mod, "TIMED_ON", "smollm2"),
                  measured=measured.get(str(mod.NUMBER), {}), smollm2=load_smollm2().get(str(mod.NUMBER), {}))


def list_lessons() -> list[Lesson]:
    """Every lesson, in order."""
    measured = load_measured()
    return [_build(name, measured) for name in _lesson_modules()]


def get_lesson(number: Union[int, str]) -> Lesson:
    """Lesson ``number`` (1-based); ValueError naming the valid numbers if there is none."""
    lessons = list_lessons()
    for lesson in lessons:
        if str(lesson.number) == str(number).strip():
            return lesson
    raise ValueError(f"there is no lesson {number}; choose one of "
                     f"{', '.join(str(l.number) for l in lessons)} (see `minipaged lessons`).")


@dataclass
class ScenarioResult:
    """A headless run of every variant of a lesson's scenario and the numbers measured from it."""

    lesson: Lesson
    runs: dict[str, Any]               # name -> Run (a FleetRun for a fleet lesson, lessons/fleet.py)
    values: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def run_scenario(lesson: Lesson, model: str, variants: Optional[Sequence[str]] = None) -> ScenarioResult:
    """Run the lesson's scenario headless (every variant unless told otherwise) and measure its numbers.
    A fleet lesson's variants are router policies, each run on replicas of its own (``fleet.run_fleet``)."""
    names = list(variants) if variants is not None else list(lesson.scenario.variants)
    runs = {name: lesson.scenario.run_headless(model, name) for name in names}
    return ScenarioResult(lesson, runs, lesson.measure(runs))


def pct(part: float, whole: float) -> float:
    """A share rounded to 4 decimals, so measured.json stays readable and comparisons are exact."""
    return round(part / whole, 4) if whole else 0.0
