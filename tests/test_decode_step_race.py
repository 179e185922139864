"""The compiled layer loop is chosen by racing the whole decode step both ways (kernels/backends/step_race.py),
not by every per-op verdict; a race whose repeats disagree is run again and, still noisy, not cached; and
``minipaged bench calibrate`` measures again and overwrites the cache. Fake timers decide every race here (no
absolute time is asserted); the real clock only has to give a verdict."""
from __future__ import annotations

import json

import pytest
import torch

from minipaged import Engine
from minipaged.cli import main
from minipaged.kernels import ModelShapes
from minipaged.kernels.backends import calibration, step_race
from minipaged.kernels.backends.calibration import COMPILED, IN_OUT, TORCH, CpuChoice, SteadyRaces
from minipaged.kernels.backends.step_race import PER_OP
from tests.test_cpu_calibration import FakeTimer, measuring, PROMPTS  # noqa: F401  (a fixture)
from tests.test_decode_layers import generate_capturing

FAST_OPS = {COMPILED: 1.0, TORCH: 2.0, IN_OUT: 3.0}
STEP_OPS = [f"{step_race.OP}@{rows}" for rows in calibration.FEW_ROWS]
SILU_NEAR_TIE = {"silu_and_mul": {COMPILED: 0.137, TORCH: 0.127}}       # issue 51's numbers, as seconds


def step(compiled: float, per_op: float) -> dict[str, dict[str, float]]:
    return {op: {COMPILED: compiled, PER_OP: per_op} for op in STEP_OPS}


def cached_files(tmp_path) -> list:
    return sorted((tmp_path / "cache" / "calibration").glob("*.json"))


def test_a_near_tie_on_one_op_no_longer_turns_the_loop_off(tiny_model_untied, measuring):
    """SiLU a hair faster in torch, the whole step faster compiled: SiLU's own verdict is torch's (for every
    step the loop does not run), and decode steps run as one compiled call."""
    measuring(FakeTimer(FAST_OPS, ops={**SILU_NEAR_TIE, **step(compiled=1.0, per_op=1.5)}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert engine.backend.choice.silu_and_mul == TORCH and engine.backend.choice.decode_step == COMPILED
    assert engine.backend._decode_layers is not None
    assert "the layer loop as one call" in engine.backend.describe()
    tokens, _logits, answers = generate_capturing(engine, PROMPTS)
    assert any(ran for _rows, ran in answers)
    reference = Engine(tiny_model_untied, block_size=4, num_blocks=64, attention_backend="torch")
    assert tokens == generate_capturing(reference, PROMPTS)[0]               # greedy tokens as the spec's


def test_a_whole_step_slower_compiled_keeps_the_loop_off(tiny_model_untied, measuring):
    """Every op faster compiled, yet the step as one call slower: the loop stays off, the ops stay compiled."""
    measuring(FakeTimer(FAST_OPS, ops=step(compiled=2.0, per_op=1.0)))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert engine.backend.choice == CpuChoice(decode_step=TORCH)
    assert engine.backend._decode_layers is None
    assert "the layer loop as one call" not in engine.backend.describe()
    _tokens, _logits, answers = generate_capturing(engine, PROMPTS)
    assert answers and not any(ran for _rows, ran in answers)


def test_the_no_compiled_decode_option_still_turns_a_winning_loop_off(tiny_model_untied, measuring):
    measuring(FakeTimer(FAST_OPS, ops=step(compiled=1.0, per_op=2.0)))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, compiled_decode=False)
    assert engine.backend.choice.decode_step == COMPILED and engine.backend._decode_layers is None


class NoisyTimer(FakeTimer):
    """FAST_OPS, except that ``op``'s repeats disagree (1x, 3x, 1x, ...) in its first ``noisy_tries`` races."""

    def __init__(self, op: str, noisy_tries: int) -> None:
        super().__init__(FAST_OPS)
        self.op, self.noisy_tries, self.samples = op, noisy_tries, 0

    def __call__(self, op: str, option: str, run) -> float:
        seconds = super().__call__(op, option, run)
        if op != self.op:
            return seconds
        self.samples += 1
        per_race = 2 * calibration.REPEATS                  # two options, interleaved
        noisy = (self.samples - 1) // per_race < self.noisy_tries
        repeat = ((self.samples - 1) % per_race) // 2
        return seconds * (3.0 if noisy and repeat % 2 else 1.0)


def test_noisy_repeats_are_retried_and_a_still_noisy_verdict_is_used_but_not_cached(tiny_model_untied, measuring,
                                                                                       monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "RACE_BUDGET_S", float("inf"))       # (a slow test machine: every repeat)
    timer = measuring(NoisyTimer("silu_and_mul", noisy_tries=99))
    lines: list[str] = []
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, load_progress=lines.append)
    assert timer.samples == (calibration.NOISE_RETRIES + 1) * 2 * calibration.REPEATS      # tried, then retried
    assert engine.backend.choice == CpuChoice()                              # used for this run
    assert "not cached: the machine was busy" in engine.backend.describe() and "silu_and_mul" in engine.backend.source
    assert any("not cached: the machine was busy" in line for line in lines), lines          # the start-up line
    assert cached_files(tmp_path) == []
    again = measuring(FakeTimer(FAST_OPS))
    Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert again.calls > 0                                                    # nothing cached: measured again


def test_a_race_noisy_once_is_retried_and_then_cached(tiny_model_untied, measuring, monkeypatch, tmp_path):
    monkeypatch.setattr(calibration, "RACE_BUDGET_S", float("inf"))
    timer = measuring(NoisyTimer(STEP_OPS[0], noisy_tries=1))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert timer.samples == 2 * 2 * calibration.REPEATS                      # one noisy race, one steady
    assert "cached in" in engine.backend.describe() and len(cached_files(tmp_path)) == 1
    assert json.loads(cached_files(tmp_path)[0].read_text())["retried"] == 1


def test_spread_ignores_too_few_repeats_and_one_hiccup():
    assert calibration.spread([1.0, 5.0]) == 0.0
    assert calibration.spread([1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0                 # one hiccup is forgiven
    assert calibration.spread([1.0, 3.0, 3.0, 1.0]) == pytest.approx(1.0)
    races = SteadyRaces(FakeTimer(FAST_OPS))
    assert races.race("op", {COMPILED: lambda: None, TORCH: lambda: None}) == {COMPILED: 1.0, TORCH: 2.0}
    assert not races.noisy


def test_bench_calibrate_measures_again_and_rewrites_the_cache(tiny_model_untied, measuring, tmp_path, capsys):
    measuring(FakeTimer({COMPILED: 2.0, TORCH: 1.0}))
    Engine(tiny_model_untied, block_size=4, num_blocks=64)                  # cached: torch everywhere
    [path] = cached_files(tmp_path)
    assert json.loads(path.read_text())["choice"]["decode_step"] == TORCH
    again = measuring(FakeTimer(FAST_OPS))
    threads = torch.get_num_threads()                                        # (the cache key holds it)
    assert main(["bench", "calibrate", "--model", tiny_model_untied, "--num-threads", str(threads)]) == 0
    assert again.calls > 0
    out = capsys.readouterr().out
    assert "decode_step" in out and "the layer loop as one call" in out and str(path) in out
    assert "decode_step@1" in out.split("medians:")[1]                       # the medians it decided by
    assert cached_files(tmp_path) == [path] and json.loads(path.read_text())["choice"] == vars(CpuChoice())
    later = measuring(FakeTimer({COMPILED: 2.0, TORCH: 1.0}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert later.calls == 0 and engine.backend.choice == CpuChoice()          # the rewritten verdict, read back


def test_the_race_mirrors_the_model_loop_and_the_real_clock_gives_a_verdict():
    """On tiny shapes: the race's per-op path (all compiled) computes the compiled loop's hidden states to the bit
    (it is the model's loop, mirrored), and the wall clock names a side with a median for each row count."""
    shapes = ModelShapes(64, 4, 2, 16, 96, 300)
    step = step_race._Step(shapes, CpuChoice())
    for rows in calibration.FEW_ROWS:
        assert torch.equal(step.compiled(rows)().clone(), step.per_op(rows)().clone())
    verdict, medians = step_race.race_decode_step(shapes, CpuChoice(), SteadyRaces(calibration.wall_clock))
    assert verdict in (COMPILED, TORCH) and set(medians) == set(STEP_OPS)
    assert all(ms > 0 for by_option in medians.values() for ms in by_option.values())
