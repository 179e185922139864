"""Compare runs (the core of watch --compare): variants parse like engine flags, and the same workload
stepped through two engines gives each its own summary."""
from __future__ import annotations

import pytest

from minipaged import Engine
from minipaged.tui.compare import CompareRun, parse_variant
from minipaged.workloads import make_workload


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
    compare.load()
    assert [run.engine.info.policy for run in compare.runs] == ["static", "continuous"]
    while not compare.done:
        compare.step()
        assert len(compare.events[0]) < 1000
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
    assert watch("--compare", "policy=static", "policy=continuous") == 2          # no side-by-side view yet
    assert "use it with --no-tui" in capsys.readouterr().err
    assert watch("--no-tui", "--compare", "policy=static") == 2
    assert "two or three variants" in capsys.readouterr().err
