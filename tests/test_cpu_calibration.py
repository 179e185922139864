"""The cpu backend chooses each compiled op by racing it against torch (kernels/backends/calibration.py).

A fake timer decides the race here, so that both verdicts (compiled faster, torch faster) and torch's
[in, out] weight layout are exercised whatever this machine measures; then the engine is checked to run the
chosen op (and only it), to give the torch backend's greedy tokens, to reuse a cached verdict, and to measure
again when the key (CPU, library build, torch, threads, shapes) changes.
"""
from __future__ import annotations

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.kernels import CpuLayerOps, CompiledLinear
from minipaged.kernels import build
from minipaged.kernels.backends import calibration
from minipaged.kernels.backends.calibration import ALL_TORCH, COMPILED, FIXED_POINT, IN_OUT, TORCH, CpuChoice
from minipaged.kernels.backends.step_race import PER_OP

PROMPTS = [[5, 9, 33, 2, 71, 8], [100, 3, 7]]
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


class FakeTimer:
    """Seconds per option as given (the op is not timed at all); counts the samples it was asked for."""

    def __init__(self, seconds: dict[str, float], many_rows: dict[str, float] | None = None,
                 ops: dict[str, dict[str, float]] | None = None) -> None:
        self.seconds, self.calls = seconds, 0
        self.ops = {"many_row_linear": many_rows or {}, **(ops or {})}      # per-op overrides of ``seconds``

    def __call__(self, op: str, option: str, run) -> float:
        self.calls += 1
        # (the fixed-point int8 loop is a compiled op: it takes the compiled time unless told otherwise; the decode
        # step's per-op path takes torch's time, so that where compiled ops win, the compiled loop wins too)
        default = self.seconds.get(TORCH if option == PER_OP else option, self.seconds.get(COMPILED))
        return self.ops.get(op, {}).get(option, default)


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Calibrate (not the suite's default cpu_ops='compiled': conftest.py), into an empty cache folder."""
    monkeypatch.setattr(calibration, "DEFAULT_CPU_OPS", calibration.MEASURE)
    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))

    def use(timer: FakeTimer) -> FakeTimer:
        monkeypatch.setattr(calibration, "wall_clock", timer)
        return timer
    return use


def count_compiled_calls(monkeypatch) -> dict[str, int]:
    calls = {"linear": 0, "layer_ops": 0, "weights": set()}
    linear_call = CompiledLinear.__call__

    def counted_linear(self, x, weight):
        if self.handles(x, weight):
            calls["linear"] += 1
            calls["weights"].add(tuple(weight.shape))
        return linear_call(self, x, weight)
    monkeypatch.setattr(CompiledLinear, "__call__", counted_linear)
    norm = CpuLayerOps.add_rms_norm

    def counted_norm(self, *args, **kwargs):
        calls["layer_ops"] += 1
        return norm(self, *args, **kwargs)
    monkeypatch.setattr(CpuLayerOps, "add_rms_norm", counted_norm)
    return calls


def torch_tokens(model: str) -> list[list[int]]:
    engine = Engine(model, block_size=4, num_blocks=64, attention_backend="torch")
    return [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]


def test_compiled_faster_everywhere_uses_every_compiled_op(tiny_model_untied, measuring, monkeypatch):
    timer = measuring(FakeTimer({COMPILED: 1.0, TORCH: 2.0, IN_OUT: 3.0}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, load_progress=lambda line: None)
    calls = count_compiled_calls(monkeypatch)                     # the steps' calls, not the race's
    assert timer.calls > 0 and engine.backend.name == "cpu" and engine.backend.choice == CpuChoice()
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert calls["linear"] > 0 and calls["layer_ops"] > 0
    assert engine.model.layers[0].qkv.is_contiguous()              # stored [out, in], as the loop reads it
    assert tokens == torch_tokens(tiny_model_untied)
    assert "compiled C kernels for decode attention, 1-7 row matmuls" in engine.backend.describe()


def test_torch_faster_everywhere_uses_no_compiled_op(tiny_model_untied, measuring, monkeypatch):
    measuring(FakeTimer({COMPILED: 2.0, TORCH: 1.0, IN_OUT: 3.0}))
    lines: list[str] = []
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, load_progress=lines.append)
    calls = count_compiled_calls(monkeypatch)
    assert engine.backend.name == "cpu" and engine.backend.choice == ALL_TORCH
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert calls["linear"] == calls["layer_ops"] == 0
    assert tokens == torch_tokens(tiny_model_untied)
    assert any(line.startswith("Attention: cpu, compiled C kernels for nothing; torch for decode attention")
               and "measured now" in line for line in lines), lines


def test_torch_in_out_layout_wins_few_rows_and_is_stored_once(tiny_model_untied, measuring, monkeypatch):
    """Weights stored [in, out] (seen as their [out, in] transpose): one copy, shared with transformers'
    module; torch multiplies, the compiled loop is never asked."""
    measuring(FakeTimer({COMPILED: 2.0, TORCH: 3.0, IN_OUT: 1.0}, many_rows={TORCH: 1.0, IN_OUT: 1.05}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    calls = count_compiled_calls(monkeypatch)
    assert engine.backend.choice.few_row_linear == IN_OUT
    layer, hf_layer = engine.model.layers[0], engine.loaded.hf_model.model.layers[0]
    for weight in (layer.qkv, layer.o, layer.gate_up, layer.down):
        assert weight.t().is_contiguous() and not weight.is_contiguous()
    assert layer.o.data_ptr() == hf_layer.self_attn.o_proj.weight.data_ptr()      # never both copies
    assert layer.down.data_ptr() == hf_layer.mlp.down_proj.weight.data_ptr()
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert calls["weights"] == {tuple(engine.model.lm_head.shape)}   # only the LM head (compiled won there)
    assert tokens == torch_tokens(tiny_model_untied)


def test_a_layout_that_slows_batches_is_not_chosen(measuring):
    """[in, out] faster for a few rows but 20% slower for a batch: the compiled loop keeps the few rows."""
    from minipaged.kernels import ModelShapes
    measuring(FakeTimer({COMPILED: 2.0, TORCH: 3.0, IN_OUT: 1.0}, many_rows={TORCH: 1.0, IN_OUT: 1.2}))
    choice, _ = calibration.calibrated_choice(ModelShapes(32, 4, 2, 8, 48, 100), 8)
    assert choice.few_row_linear == COMPILED


@pytest.mark.parametrize("tiled_wins", [True, False], ids=["tiled-wins", "torch-wins"])
def test_batches_take_the_tiled_multiply_only_where_it_won(tiny_model_untied, measuring, monkeypatch, tiled_wins):
    """The batch verdict decides who multiplies eight token rows or more (prefill chunks, decode batches): the
    compiled tiled loop where it won the race, torch where it lost; a few rows follow their own verdict, and the
    greedy tokens are transformers' either way."""
    compiled_batch = 0.5 if tiled_wins else 2.0
    measuring(FakeTimer({COMPILED: 1.0, TORCH: 2.0, IN_OUT: 3.0},
                        many_rows={COMPILED: compiled_batch, TORCH: 1.0, IN_OUT: 1.05}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert engine.backend.choice.batch_linear == (COMPILED if tiled_wins else TORCH)
    assert engine.backend.choice.few_row_linear == COMPILED
    rows_seen: list[int] = []
    linear_call = CompiledLinear.__call__

    def recording(self, x, weight):
        rows_seen.append(x.shape[0])
        return linear_call(self, x, weight)
    monkeypatch.setattr(CompiledLinear, "__call__", recording)
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert tokens == torch_tokens(tiny_model_untied)
    assert any(rows <= 7 for rows in rows_seen)                     # decode steps: the few-row verdict
    assert any(rows > 7 for rows in rows_seen) == tiled_wins, rows_seen      # prefill: the batch verdict
    assert ("matmuls of 8+ rows" in engine.backend.describe().split(";")[0]) == tiled_wins


@pytest.mark.parametrize("tiled_wins", [True, False], ids=["tiled-wins", "widening-wins"])
def test_int8_batches_take_the_tiled_multiply_only_where_it_won(tiny_model_untied, measuring, tiled_wins):
    """With --quantization int8, eight token rows or more go to the tiled int8 multiply where it beat widening the
    weights for torch's matmul in the race, to the widening where it lost; fewer rows always to the compiled loops.
    The int8 engine's greedy tokens are the same either way (the same products, summed in another order)."""
    from minipaged.kernels.int8 import Int8Weight
    measuring(FakeTimer({COMPILED: 1.0, TORCH: 2.0, IN_OUT: 3.0},
                        ops={"int8_batch_linear": {COMPILED: 1.0 if tiled_wins else 3.0, TORCH: 2.0}}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, quantization="int8")
    assert engine.backend.choice.int8_batch_linear == (COMPILED if tiled_wins else TORCH)
    weight = engine.model.layers[0].qkv
    assert isinstance(weight, Int8Weight)
    int8 = engine.backend._int8
    assert int8.handles_compiled(torch.randn(7, weight.shape[1]), weight)
    assert int8.handles_compiled(torch.randn(9, weight.shape[1]), weight) == tiled_wins
    assert ("8+ row int8 matmuls" in engine.backend.describe().split(";")[0]) == tiled_wins
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    other = Engine(tiny_model_untied, block_size=4, num_blocks=64, quantization="int8", attention_backend="torch")
    assert tokens == [o.token_ids for o in other.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize("fixed_point_wins", [True, False], ids=["fixed-point-wins", "widening-wins"])
def test_one_request_int8_decodes_take_the_one_row_loop_that_won(tiny_model_untied, measuring, fixed_point_wins):
    """With --quantization int8, one to three token rows go to the fixed-point loop where it won its race against
    the widening loop, to the widening loop where it lost; the greedy tokens are the same either way (the two
    compute the same products, to float32's rounding)."""
    measuring(FakeTimer({COMPILED: 1.0, TORCH: 2.0, IN_OUT: 3.0},
                        ops={"int8_one_row": {FIXED_POINT: 1.0 if fixed_point_wins else 3.0, COMPILED: 2.0}}))
    engine = Engine(tiny_model_untied, block_size=4, num_blocks=64, quantization="int8")
    assert engine.backend.choice.int8_one_row == (FIXED_POINT if fixed_point_wins else COMPILED)
    kernel, _name = engine.backend._int8.one_row
    assert kernel.__name__ == ("int8_fixed_point_linear" if fixed_point_wins else "int8_small_batch_linear")
    assert ("fixed point for 1-3" if fixed_point_wins else "widening for 1-3") in engine.backend.describe()
    calls = []
    library = engine.backend._int8.library
    original = getattr(library, kernel.__name__)

    def counted(*args):
        calls.append(args[4])                                   # token rows
        return original(*args)
    engine.backend._int8.one_row = (counted, _name)
    tokens = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
    assert calls and all(rows <= 3 for rows in calls)
    other = Engine(tiny_model_untied, block_size=4, num_blocks=64, quantization="int8", attention_backend="torch")
    assert tokens == [o.token_ids for o in other.generate(PROMPTS, PARAMS)]


def test_the_verdict_is_cached_and_measured_again_when_the_key_changes(tiny_model_untied, measuring, monkeypatch):
    first = measuring(FakeTimer({COMPILED: 2.0, TORCH: 1.0, IN_OUT: 3.0}))
    Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert first.calls > 0
    second = measuring(FakeTimer({COMPILED: 1.0, TORCH: 2.0, IN_OUT: 3.0}))
    again = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert second.calls == 0 and again.backend.choice == ALL_TORCH            # the cached verdict, not a race
    assert "measured on this machine earlier" in again.backend.describe()
    monkeypatch.setattr(build, "library_identity", lambda: "another CPU or compiler")
    rebuilt = Engine(tiny_model_untied, block_size=4, num_blocks=64)
    assert second.calls > 0 and rebuilt.backend.choice == CpuChoice()        # a new key: measured again


def test_the_real_clock_gives_a_verdict_for_every_op(measuring):
    """No fake: the race runs (on tiny shapes, quickly) and names a side for every op."""
    from minipaged.kernels import ModelShapes
    choice, medians = calibration.calibrate(ModelShapes(64, 4, 2, 16, 96, 300), 16)
    assert set(medians) >= {"few_row_linear", "many_row_linear", "lm_head", "argmax", "decode_attention", "int8_one_row"}
    assert all(value in (COMPILED, TORCH, IN_OUT, FIXED_POINT) for value in vars(choice).values())
    assert choice.int8_one_row in (FIXED_POINT, COMPILED)           # two compiled loops, never torch
    assert all(t > 0 for by_option in medians.values() for t in by_option.values())


def test_a_wrong_override_is_refused(tiny_model):
    from minipaged.config import ConfigError
    from minipaged.kernels import ModelShapes
    with pytest.raises(ValueError, match="cpu_ops must be 'measure', 'compiled' or 'torch'"):
        calibration.calibrated_choice(ModelShapes(64, 4, 2, 16, 96, 300), 16, cpu_ops="fast")
    with pytest.raises(ConfigError, match="cpu_ops must be 'measure' or 'compiled' or 'torch'"):
        Engine(tiny_model, cpu_ops="fast")


@pytest.mark.parametrize("cpu_ops", ["torch", "compiled"])
def test_the_cpu_ops_option_reaches_the_backend(tiny_model, cpu_ops):
    """--cpu-ops takes every op from one side without measuring, whatever the suite's default."""
    engine = Engine(tiny_model, attention_backend="cpu", cpu_ops=cpu_ops, num_blocks=16, block_size=4)
    assert engine.backend.choice == (ALL_TORCH if cpu_ops == "torch" else CpuChoice())
    assert f"cpu_ops='{cpu_ops}'" in engine.backend.describe()


def test_a_race_stops_early_when_it_runs_long(monkeypatch):
    """On a crowded machine an op can be 100 times slower than usual: a race past its budget keeps the
    rounds it has (at least one) instead of holding start-up."""
    timer = FakeTimer({COMPILED: 1.0, TORCH: 2.0})
    options = {COMPILED: lambda: None, TORCH: lambda: None}
    assert calibration.race("op", options, timer) == {COMPILED: 1.0, TORCH: 2.0} and timer.calls == 2 * 5
    monkeypatch.setattr(calibration, "RACE_BUDGET_S", 0.0)
    timer.calls = 0
    assert calibration.race("op", options, timer) == {COMPILED: 1.0, TORCH: 2.0} and timer.calls == 2
