"""Compare runs: the same workload through two or three engines that differ in a few options, stepped
together, with one summary line each. The headless core of ``minipaged watch --compare`` (issue 16); the
side-by-side screen on top of it is ``compare_app.CompareApp``.

Variants are written as ``name=value`` pairs (``"policy=static"``, ``"num_blocks=32 preemption_mode=swap"``,
``"enable_prefix_caching=false"``), checked against the engine's own flags, so anything an engine flag can
set can be compared.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from statistics import mean
from typing import Any, Optional, Sequence

from minipaged.events import StepEvent
from minipaged.options import add_engine_arguments, engine_flags, engine_options
from minipaged.workloads import Workload

from .driver import EngineFactory, LiveRun


def parse_variant(text: str) -> dict[str, Any]:
    """``"policy=static num_blocks=32"`` -> ``{"policy": "static", "num_blocks": 32}``, typed and checked as
    the matching engine flags are; a bad name or value raises ValueError naming the choices."""
    flags = {f.name: f for f in engine_flags()}
    words: list[str] = []
    for pair in text.replace(",", " ").split():
        name, sep, value = pair.partition("=")
        name = name.strip().lstrip("-").replace("-", "_")
        if not sep or name not in flags:
            raise ValueError(f"compare variant {pair!r}: write name=value with an engine option name "
                             f"({', '.join(flags)}).")
        flag = flags[name]
        if flag.switch_to is None:
            words += [flag.flag, value]
        elif value.lower() not in ("true", "false"):
            raise ValueError(f"compare variant {pair!r}: {name} is true or false.")
        elif (value.lower() == "true") == flag.switch_to:
            words.append(flag.flag)
    parser = argparse.ArgumentParser(prog="--compare", add_help=False, exit_on_error=False)
    add_engine_arguments(parser)
    try:
        args = parser.parse_args(words)
    except (argparse.ArgumentError, SystemExit) as exc:
        raise ValueError(f"compare variant {text!r}: {exc}") from None
    return engine_options(args)


@dataclass(frozen=True)
class RunSummary:
    """One variant's line under the comparison."""

    label: str
    steps: int
    tokens_per_step: float
    preemptions: int
    prefix_cache_hit_rate: float
    mean_ttft_s: Optional[float]

    def line(self) -> str:
        ttft = f"{self.mean_ttft_s * 1e3:.0f} ms" if self.mean_ttft_s is not None else "-"
        return (f"{self.label}: {self.steps} steps, {self.tokens_per_step:.1f} tok/step, "
                f"{self.preemptions} preemptions, hit rate {self.prefix_cache_hit_rate:.0%}, mean TTFT {ttft}")


def summarize(label: str, events: Sequence[StepEvent]) -> RunSummary:
    tokens = sum(e.budget_used for e in events)
    last = events[-1].counters if events else {}
    ttfts = [f.ttft_s for e in events for f in e.finished if f.ttft_s is not None]
    return RunSummary(label, len(events), tokens / len(events) if events else 0.0,
                      int(last.get("preemptions_recompute", 0) + last.get("preemptions_swap", 0)),
                      float(last.get("prefix_cache_hit_rate", 0.0)), mean(ttfts) if ttfts else None)


class CompareRun:
    """Two or three LiveRuns of one workload; ``step`` advances every unfinished one by one engine step."""

    def __init__(self, factories: Sequence[tuple[str, EngineFactory]], workload: Workload) -> None:
        self._take([(label, LiveRun(factory, workload)) for label, factory in factories])

    @classmethod
    def from_runs(cls, runs: Sequence[tuple[str, LiveRun]]) -> "CompareRun":
        """Runs built elsewhere (a lesson's variants are LessonRuns, fed by the lesson's own scenario)."""
        compare = cls.__new__(cls)
        compare._take(runs)
        return compare

    def _take(self, runs: Sequence[tuple[str, LiveRun]]) -> None:
        if not 2 <= len(runs) <= 3:
            raise ValueError(f"--compare takes two or three variants, got {len(runs)}.")
        self.labels = [label for label, _ in runs]
        self.runs = [run for _, run in runs]
        self.events: list[list[StepEvent]] = [[] for _ in runs]

    def load(self) -> None:
        for run in self.runs:
            run.load()

    @property
    def done(self) -> bool:
        return all(run.done for run in self.runs)

    def step(self) -> list[Optional[StepEvent]]:
        """One step of each run that still has work (None for one that has finished)."""
        out: list[Optional[StepEvent]] = []
        for run, events in zip(self.runs, self.events):
            event = None if run.done else run.step()
            if event is not None:
                events.append(event)
            out.append(event)
        return out

    def summaries(self) -> list[RunSummary]:
        return [summarize(label, events) for label, events in zip(self.labels, self.events)]
