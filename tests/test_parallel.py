"""Tensor and pipeline parallelism (minipaged.parallel) on CPU with gloo: same tokens as one process.

Every multi-process engine here is tiny (2 layers, 64 wide), uses one thread per rank and a world size of 2
(this machine has 2 cores), and bounds every wait: a stuck rank fails a test, it does not hang it.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.config import ConfigError
from minipaged.parallel import ParallelLayout
from minipaged.parallel.distributed_runner import WorkerError
from minipaged.parallel.launch import free_port
from minipaged.parallel.sharding import vocab_slice
from tests.conftest import random_prompts
from tests.test_model_vs_transformers import run_and_capture_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
TIMEOUT = 60          # seconds any rank may wait for another before the engine gives up


def parallel_engine(model: str, **options) -> Engine:
    options = {"block_size": 4, "num_blocks": 64, "num_threads": 1, "distributed_timeout": TIMEOUT, **options}
    return Engine(model, **options)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(random.Random(11), 4, 3, 21)


@pytest.fixture(scope="module")
def single(tiny_model, prompts):
    """tp=1, pp=1: the tokens and logits every layout must reproduce."""
    engine = parallel_engine(tiny_model)
    outs, logits, _ = run_and_capture_logits(engine, prompts, GREEDY.max_tokens)
    return engine, [o.token_ids for o in outs], logits


# ---------------------------------------------------------------- layout and errors, no processes needed
def test_sizes_that_do_not_divide_name_the_sizes_that_work():
    smollm2 = ParallelLayout(tp=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 .* 9 attention heads, 3 KV heads.*sizes that work: 1, 3\."):
        smollm2.check(num_heads=9, num_kv_heads=3, intermediate_size=1536, num_layers=30)
    ParallelLayout(tp=3).check(num_heads=9, num_kv_heads=3, intermediate_size=1536, num_layers=30)
    with pytest.raises(ConfigError, match="pipeline_parallel_size=31 is more than the model's 30 layers"):
        ParallelLayout(pp=31).check(num_heads=9, num_kv_heads=3, intermediate_size=1536, num_layers=30)


def test_engine_refuses_a_bad_size_before_starting_any_worker(tiny_model):
    with pytest.raises(ConfigError, match="sizes that work: 1, 2"):
        Engine(tiny_model, tensor_parallel_size=4, num_blocks=8)         # 4 heads but 2 KV heads
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        Engine(tiny_model, tensor_parallel_size=0, num_blocks=8)


def test_stages_split_layers_consecutively_and_header_text():
    layout = ParallelLayout(tp=3, pp=2)
    assert [list(layout.layer_range(5, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [layout.stage_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert ParallelLayout(tp=3).describe(9, 3, 30) == "tp=3: 3 heads, 1 KV head per rank"
    assert ParallelLayout(pp=2).describe(9, 3, 30) == "pp=2: layers 0-14 | 15-29"
    slices = [vocab_slice(259, 2, r) for r in range(2)]
    assert [len(s) for s in slices] == [130, 129] and slices[0].stop == slices[1].start


def test_flags_exist_with_vllm_spelling():
    import argparse

    from minipaged.options import add_engine_arguments, engine_options
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["-tp", "2", "--pipeline-parallel-size", "3"])
    assert engine_options(args) == {"tensor_parallel_size": 2, "pipeline_parallel_size": 3}


# ---------------------------------------------------------------- two ranks, spawned
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_ranks_give_the_tokens_and_logits_of_one(tiny_model, prompts, single, layout):
    _, tokens, logits = single
    with parallel_engine(tiny_model, **layout) as engine:
        outs, parallel_logits, events = run_and_capture_logits(engine, prompts, GREEDY.max_tokens)
        assert [o.token_ids for o in outs] == tokens
        for rid, rows in logits.items():
            torch.testing.assert_close(torch.stack(parallel_logits[rid]), torch.stack(rows), atol=1e-5, rtol=0)
        comm = [ev.counters["communication_seconds"] for ev in events]
        assert comm == sorted(comm) and comm[-1] > 0                # a running total that grew
        assert engine.stats()["communication_seconds"] == comm[-1]


def test_tp2_matches_transformers_generate(tiny_model, prompts, single):
    engine, tokens, _ = single
    hf = engine.loaded.hf_model
    for prompt, out in zip(prompts, tokens):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                          min_new_tokens=GREEDY.max_tokens, do_sample=False, pad_token_id=0)[0, len(prompt):]
        assert out == ref.tolist()
    # (the tp=2 and pp=2 runs above give exactly ``tokens``, so they match transformers too)


def test_kv_pool_per_rank_grows_with_tp_and_the_header_says_how(tiny_model):
    budget = {"num_blocks": None, "kv_cache_memory": 0.001}         # GiB, per rank
    one = Engine(tiny_model, block_size=4, num_threads=1, **budget)
    with parallel_engine(tiny_model, tensor_parallel_size=2, **budget) as two:
        assert two.info.num_blocks == 2 * one.info.num_blocks
        assert two.info.kv_bytes_per_token * 2 == one.info.kv_bytes_per_token
        assert two.info.parallel == "tp=2: 2 heads, 1 KV head per rank"
        assert one.info.parallel is None
        with pytest.raises(ConfigError, match="already runs a parallel engine"):
            parallel_engine(tiny_model, pipeline_parallel_size=2)


def test_rank0_keeps_only_its_own_shard_not_the_whole_model(tiny_model):
    """The point of splitting a model: no rank, rank 0 included, holds the whole of it. Rank 0 loads and cuts
    on the CPU, keeps its half of every matrix in tensors of its own (not views that would keep the full
    weights alive), and drops transformers' model."""
    one = Engine(tiny_model, block_size=4, num_threads=1)
    matrices = ("qkv", "o", "gate_up", "down")

    def matrix_bytes(model) -> int:
        return sum(getattr(w, m).numel() * getattr(w, m).element_size() for w in model.layers for m in matrices)

    with parallel_engine(tiny_model, tensor_parallel_size=2) as two:
        assert one.loaded.hf_model is not None and two.loaded.hf_model is None
        assert matrix_bytes(two.model) * 2 == matrix_bytes(one.model)
        for w in two.model.layers:
            for m in matrices:
                t = getattr(w, m)
                assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), m   # its own storage
        assert two.tokenizer is not None and two.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].token_ids


def test_bench_refuses_the_transformers_baseline_for_a_split_model(tiny_model, capsys):
    from minipaged.cli import main
    from minipaged.parallel import distributed_runner

    try:
        assert main(["bench", "throughput", "--model", tiny_model, "-tp", "2", "--num-prompts", "2",
                     "--baseline", "transformers", "--block-size", "4", "--num-threads", "1"]) == 2
    finally:
        distributed_runner.close_all()                 # what the CLI's entry point does on the way out
    assert "drop --tensor-parallel-size" in capsys.readouterr().err


@pytest.mark.parametrize("layout, mode", [({"tensor_parallel_size": 2}, "swap"), ({"pipeline_parallel_size": 2}, "swap"),
                                          ({"tensor_parallel_size": 2}, "recompute")],
                         ids=["tp2-swap", "pp2-swap", "tp2-recompute"])
def test_two_ranks_under_preemption_prefix_caching_and_chunks(tiny_model, layout, mode):
    """Few blocks, a small token budget and shared prefixes: swaps, chunked prefills (steps that sample
    nothing) and cache hits must land in the same block ids on both ranks, or the tokens would differ."""
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(12)]
    prompts = [shared + p for p in random_prompts(rng, 5, 4, 14)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    options = {"num_blocks": 16, "max_num_batched_tokens": 16, "preemption_mode": mode, "num_cpu_blocks": 64}
    expected = [o.token_ids for o in parallel_engine(tiny_model, **options).generate(prompts, params)]
    with parallel_engine(tiny_model, **layout, **options) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
    assert [o.token_ids for o in outs] == expected
    assert stats[f"preemptions_{mode}"] > 0 and stats["prefix_cache_hits"] > 0


# ---------------------------------------------------------------- faults
def wait_for_error(engine: Engine, prompts) -> tuple[str, float]:
    start = time.monotonic()
    with pytest.raises(WorkerError) as err:
        engine.generate(prompts, GREEDY)
    return str(err.value), time.monotonic() - start


def test_a_killed_worker_stops_the_engine_with_a_clear_error(tiny_model, prompts):
    engine = parallel_engine(tiny_model, tensor_parallel_size=2)
    try:
        worker = engine.runner.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        message, seconds = wait_for_error(engine, prompts)
        assert "worker rank 1 exited" in message and seconds < 5
        with pytest.raises(WorkerError):                            # and it stays stopped
            engine.generate(prompts, GREEDY)
    finally:
        engine.close()


def test_a_hung_worker_stops_the_engine_within_the_timeout(tiny_model, prompts):
    engine = parallel_engine(tiny_model, tensor_parallel_size=2, distributed_timeout=3)
    worker = engine.runner.workers.processes[0]
    try:
        os.kill(worker.pid, signal.SIGSTOP)                          # alive, but answers nothing
        message, seconds = wait_for_error(engine, prompts)
        assert "did not answer within distributed_timeout=3 s" in message and seconds < 15
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.close()
    assert not worker.is_alive()


# ---------------------------------------------------------------- torchrun, as on two machines
def test_torchrun_two_processes_give_the_spawned_tokens(tiny_model, prompts, single):
    script = Path(__file__).parent / "parallel_scripts" / "generate_tp2.py"
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    result = subprocess.run(
        [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port()), str(script), tiny_model, "2", json.dumps(prompts)],
        capture_output=True, text=True, timeout=240, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
    got = json.loads(line.removeprefix("RESULT "))
    assert got == {"tokens": single[1], "parallel": "tp=2: 2 heads, 1 KV head per rank"}


# ---------------------------------------------------------------- the emulation: all ranks as threads
def emulated_engine(model: str, **layout) -> Engine:
    from minipaged.parallel.emulate import EmulatedRunner
    engine = Engine(model, block_size=4, num_blocks=64, num_threads=1)
    runner = EmulatedRunner(engine.model, ParallelLayout(**layout), 64, 4, engine.backend)
    engine.runner = engine.core.runner = engine.core.executor.runner = runner     # the executor runs the steps
    return engine


def test_tp2_logits_are_bitwise_those_of_the_emulation_with_the_same_reduction_order(tiny_model, prompts):
    _, emulated, _ = run_and_capture_logits(emulated_engine(tiny_model, tp=2), prompts, GREEDY.max_tokens)
    with parallel_engine(tiny_model, tensor_parallel_size=2) as engine:
        _, real, _ = run_and_capture_logits(engine, prompts, GREEDY.max_tokens)
    for rid, rows in real.items():
        assert torch.equal(torch.stack(rows), torch.stack(emulated[rid]))


@pytest.mark.parametrize("layout", [{"tp": 2, "pp": 2}, {"tp": 2}, {"pp": 2}], ids=["tp2xpp2", "tp2", "pp2"])
def test_emulated_layouts_give_the_tokens_of_one_rank(tiny_model_untied, layout):
    """tp=2 x pp=2 needs 4 ranks, too many processes for 2 cores: threads run the same per-rank code."""
    prompts = random_prompts(random.Random(2), 3, 2, 17)
    expected = [o.token_ids for o in parallel_engine(tiny_model_untied).generate(prompts, GREEDY)]
    outs = emulated_engine(tiny_model_untied, **layout).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == expected


def test_the_cli_stops_its_workers_and_exits_clean(tiny_model):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "minipaged", "generate", "--model", tiny_model, "-tp", "2",
                             "--threads", "1", "--cpu-ops", "compiled", "--max-tokens", "4", "--no-chat", "hello"],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tp=2: 2 heads, 1 KV head per rank" in result.stderr
    assert "Traceback" not in result.stderr and "lost rank 0" not in result.stderr    # stopped, not abandoned
