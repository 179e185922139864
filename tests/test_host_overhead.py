"""bench/host_overhead.py splits a decode step's host time into parts: each part must get the time that was
spent in it (not the forward pass's, not another part's), and the engine must come out of it untouched."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

BUSY_S = 0.004


def burn_cpu(seconds: float) -> None:
    """Spin on this thread's CPU clock (what the bench reads), so a loaded machine cannot shorten it."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.fixture()
def host_overhead(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import host_overhead
    return host_overhead


@pytest.mark.parametrize("part, owner, method", [("detokenize", "outputs", "process_tokens"), ("outputs", "outputs", "drain"),
                                                 ("schedule", "scheduler", "schedule"),
                                                 ("prepare_inputs", "runner", "prepare")])
def test_time_spent_in_a_part_is_counted_in_that_part_and_in_the_host_time(tiny_model, host_overhead,
                                                                          part, owner, method):
    from minipaged import Engine
    engine = Engine(tiny_model, block_size=4, num_blocks=128, max_num_seqs=4)
    target = getattr(engine, owner)
    original = getattr(target, method)

    def slow(*args, **kwargs):
        burn_cpu(BUSY_S)
        return original(*args, **kwargs)
    setattr(target, method, slow)
    record = host_overhead.measure(engine, num_requests=4, steps=3, warmup=1, prompt_len=6)
    cpu = record["cpu_ms"]
    assert cpu[part] >= 1e3 * BUSY_S
    assert cpu["host"] >= 1e3 * BUSY_S
    assert cpu["forward"] < 1e3 * BUSY_S            # not counted as device work
    others = [p for p in host_overhead.TOP_LEVEL if p != part]
    assert all(cpu[p] < 1e3 * BUSY_S for p in others), cpu
    # the parts and "other" add up to the host time, step by step (medians of sums need not add up exactly)
    assert sum(cpu[p] for p in host_overhead.TOP_LEVEL) + cpu["other"] == pytest.approx(cpu["host"], rel=0.5)
    # every wrapper is gone, the slow method the test put there is back, and the engine is empty
    assert getattr(target, method) is slow
    assert "step" not in vars(engine) and "_emit" not in vars(engine) and "update_from_output" not in vars(
        engine.scheduler)
    assert engine.sampler.argmax.__name__ != "timed"
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_script_runs_end_to_end_with_tiny_settings_and_writes_its_json(host_overhead, tmp_path, monkeypatch):
    import json
    import sys

    import torch
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)     # the engine's one thread: not for the suite
    monkeypatch.setattr(sys, "argv", ["host_overhead.py", "--requests", "3", "--steps", "2", "--warmup", "1",
                                      "--tokenizers", "byte", "--out", str(tmp_path)])
    host_overhead.main()
    record = json.loads((tmp_path / "host_overhead.json").read_text())["runs"]["byte"]
    assert record["requests"] == 3 and record["tokenizer"] == "byte"
    for clock in ("cpu_ms", "wall_ms"):
        assert set(host_overhead.PARTS) | {"step", "host", "other"} <= set(record[clock])
        assert 0 < record[clock]["host"] < record[clock]["step"]
