"""Threads: torch's CPU thread count is an engine option, with a default that leaves a core free."""
from __future__ import annotations

import os

import pytest
import torch

from minipaged import ConfigError
from minipaged.cli import make_parser
from minipaged.config import EngineConfig
from minipaged.memory import apply_num_threads
from minipaged.options import engine_options


@pytest.fixture(autouse=True)
def keep_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_engine_sets_and_reports_its_thread_count(tiny_engine_factory):
    engine = tiny_engine_factory(num_threads=1)
    assert torch.get_num_threads() == 1 and engine.info.num_threads == 1


@pytest.mark.parametrize("env, asked, expected", [
    (None, None, max(1, (os.cpu_count() or 1) - 1)),       # all cores but one
    ("3", None, 3),                                          # the user's OMP_NUM_THREADS wins over the default
    ("3", 2, 2),                                             # ... and an explicit option over both
])
def test_the_default_leaves_a_core_free_unless_told_otherwise(monkeypatch, env, asked, expected):
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert apply_num_threads(EngineConfig(num_threads=asked)) == expected == torch.get_num_threads()


def test_zero_leaves_torchs_own_setting_alone():
    torch.set_num_threads(2)
    assert apply_num_threads(EngineConfig(num_threads=0)) == 2 == torch.get_num_threads()


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_a_bad_thread_count_is_refused_with_the_fix(bad):
    with pytest.raises(ConfigError, match="num_threads must be an integer >= 0"):
        EngineConfig(num_threads=bad).validate()


@pytest.mark.parametrize("command", ["generate", "watch"])
def test_threads_is_a_flag_of_every_engine_command(command):
    for spelling in ("--threads", "--num-threads"):
        args = make_parser().parse_args([command, spelling, "1"])
        assert engine_options(args) == {"num_threads": 1}


def test_the_header_names_the_thread_count_and_old_traces_still_load():
    import dataclasses
    from pathlib import Path

    from minipaged.trace import read_trace
    from minipaged.tui.app import WatchApp

    info, events = read_trace(str(Path(__file__).parent / "data" / "watch_trace.jsonl"))
    assert info.num_threads is None                                   # recorded before threads were kept
    assert "thread" not in WatchApp(replay=(info, events))._topbar().plain
    app = WatchApp(replay=(dataclasses.replace(info, num_threads=1), events))
    assert "1 thread " in app._topbar().plain
