"""Compare runs (the core of watch --compare): variants parse like engine flags, and the same workload
stepped through two engines gives each its own summary."""
from __future__ import annotations

import pytest

from minipaged import Engine
from minipaged.tui.compare import CompareRun, parse_variant
from minipaged.workloads import make_workload


def policies_after_running(compare: CompareRun) -> list[str]:
    """Load and step every run to its end (bounded); each engine's policy, to check who ran what."""
    compare.load()
    while not compare.done:
        compare.step()
        assert max(len(events) for events in compare.events) < 1000
    return [run.engine.info.policy for run in compare.runs]


def test_variants_parse_as_engine_flags_do():
    assert parse_variant("policy=static") == {"policy": "static"}
    assert parse_variant("num_blocks=32, preemption_mode=swap") == {"num_blocks": 32, "preemption_mode": "swap"}
    assert parse_variant("enable_prefix_caching=false") == {"enable_prefix_caching": False}
    assert parse_variant("enable_prefix_caching=true") == {}          # the default: nothing to set
    with pytest.raises(ValueError, match="engine option name"):
        parse_variant("blocks=32")
    with pytest.raises(ValueError, match="invalid choice"):
        parse_variant("policy=fastest")


def test_static_and_continuous_on_the_same_workload(tiny_model):
    workload = make_workload("chat", num_requests=8, rate=1.0, max_tokens=12)
    variants = [(text, parse_variant(text)) for text in ("policy=static", "policy=continuous")]
    compare = CompareRun([(text, lambda progress, o=options: Engine(tiny_model, num_blocks=256, **o))
                          for text, options in variants], workload)
    assert policies_after_running(compare) == ["static", "continuous"]
    static, continuous = compare.summaries()
    finished = [sum(len(e.finished) for e in events) for events in compare.events]
    assert finished == [8, 8]
    assert static.steps > continuous.steps and continuous.tokens_per_step > static.tokens_per_step
    assert static.line().startswith(f"policy=static: {static.steps} steps, ")
    with pytest.raises(ValueError, match="two or three"):
        CompareRun([("a", None)], workload)


def test_watch_compare_prints_a_summary_per_variant(tiny_model, capsys):
    from minipaged.cli import make_parser
    from minipaged.tui import run_watch

    def watch(*extra: str) -> int:
        return run_watch(make_parser().parse_args(["watch", "--model", tiny_model, "--workload", "chat",
                                                   "--num-requests", "4", "--max-tokens", "6", *extra]))

    assert watch("--no-tui", "--compare", "policy=static", "policy=continuous") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "workload chat, 4 requests, the same for each run:"
    assert lines[1].startswith("  policy=static: ") and lines[2].startswith("  policy=continuous: ")
    assert watch("--no-tui", "--compare", "policy=static", "policy=continuous", "--record", "x.jsonl") == 2
    assert "--compare cannot --record" in capsys.readouterr().err
    assert watch("--no-tui", "--compare", "policy=static") == 2
    assert "two or three variants" in capsys.readouterr().err


def test_watch_compare_replays_and_lessons(tiny_model, capsys):
    """--compare --replay A --replay B summarises recorded runs; --lesson N --compare takes the lesson's runs."""
    from pathlib import Path

    from minipaged.cli import make_parser
    from minipaged.tui import run_watch
    from minipaged.tui.lesson_panel import build_lesson_compare

    data = Path(__file__).parent / "data"
    static, continuous = (str(data / f"compare_{p}.jsonl") for p in ("static", "continuous"))

    def watch(*argv: str) -> int:
        return run_watch(make_parser().parse_args(["watch", *argv]))

    assert watch("--no-tui", "--compare", "--replay", static, "--replay", continuous) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "recorded runs side by side:"
    assert lines[1].startswith("  compare_static.jsonl: 24 steps")          # as recorded (see test_compare_app)
    assert lines[2].startswith("  compare_continuous.jsonl: 19 steps")
    assert watch("--replay", static, "--replay", continuous) == 2
    assert "with --compare" in capsys.readouterr().err
    assert watch("--no-tui", "--compare", "policy=static", "--replay", static, "--replay", continuous) == 2
    assert "each trace is one run" in capsys.readouterr().err
    assert watch("--no-tui", "--compare", "--replay", static) == 2
    assert "two or three traces" in capsys.readouterr().err
    assert watch("--no-tui", "--compare", "--lesson", "1") == 2
    assert "nothing to compare" in capsys.readouterr().err

    lesson, runs, _description = build_lesson_compare(make_parser().parse_args(
        ["watch", "--model", tiny_model, "--lesson", "2", "--compare"]))
    assert [label for label, _run in runs] == ["continuous (the lesson's options)", "static (policy=static)"]
    compare = CompareRun.from_runs(runs)
    assert policies_after_running(compare) == ["continuous", "static"]
    continuous_run, static_run = compare.summaries()
    assert static_run.steps > continuous_run.steps
