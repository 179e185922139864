"""The compiled CPU decode kernel (kernels/cpu_paged_attention.c) against the one-request-at-a-time reference,
its guards (bad indices raise instead of reading outside the cache), its fallback where it cannot be built,
and the engine's choice of it: greedy outputs the same as with the torch path."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from attention_batches import make_batch, random_specs
from minipaged import Engine, SamplingParams
from minipaged.config import ConfigError
from kernel_dispatch import paged_attention, plan_attention
from minipaged.kernels import (cpu_kernel_available, cpu_kernel_problem, paged_attention_reference,
                               paged_decode_attention_cpu)

TOL = dict(atol=1e-5, rtol=1e-5)


def test_the_kernel_builds_here():
    """CI has a C compiler, so a failure to build is a bug, not a reason to skip."""
    assert cpu_kernel_problem(64) is None
    assert cpu_kernel_available(16) and cpu_kernel_available(128)


@pytest.mark.parametrize("seed", range(16))
def test_matches_reference_on_mixed_batches(seed):
    """Decodes by the kernel, prefill chunks by torch, in one call: GQA ratios, head sizes, block sizes,
    padded (-1) and strided block tables, idle requests, with a per-step plan or without."""
    rng = random.Random(3000 + seed)
    group, block_size = rng.choice([1, 3, 4]), rng.choice([1, 4, 16, 32])
    head_dim = rng.choice([16, 32, 64, 128])
    decode_only = rng.random() < 0.5
    specs = [(rng.randint(1, 120), 1) for _ in range(rng.randint(1, 6))] if decode_only \
        else random_specs(rng, rng.randint(1, 6), max_ctx=90) + [(rng.randint(1, 40), 0)]
    rng.shuffle(specs)
    batch = make_batch(specs, block_size=block_size, group=group, head_dim=head_dim, seed=seed,
                       num_kv_heads=rng.choice([1, 2, 3]), table_stride=rng.choice([1, 2]))
    q, k_cache, v_cache, tables, seq_lens, starts = batch
    ref = paged_attention_reference(*batch, 0.3)
    hints = plan_attention(tables, block_size, seq_lens.tolist(), starts.tolist(), backend="cpu")
    for kw in ({}, hints, hints):              # planned inside the call, or once for every layer (checked once)
        torch.testing.assert_close(paged_attention(*batch, 0.3, backend="cpu", **kw), ref, **TOL)


@pytest.mark.parametrize("seed", range(4))
def test_verification_rows_attend_as_decodes_each_seeing_its_context_up_to_itself(seed):
    """A speculative verification (k + 1 query rows on top of a context) planned as k + 1 decodes: row j sees
    ``seq_len - q_len + j + 1`` keys. By the compiled kernel, and by torch's padded attention with the plan's
    mask, the reference's causal attention; a longer chunk stays a prefill chunk."""
    from minipaged.kernels import paged_attention_torch, plan_torch_attention
    rng = random.Random(4000 + seed)
    specs = [(rng.randint(9, 70), rng.randint(2, 8)) for _ in range(3)] + [(rng.randint(1, 40), 1), (60, 20)]
    rng.shuffle(specs)
    batch = make_batch(specs, block_size=rng.choice([4, 16]), group=rng.choice([1, 3]), seed=seed)
    q, k_cache, v_cache, tables, seq_lens, starts = batch
    ref = paged_attention_reference(*batch, 0.3)
    plan = plan_torch_attention(tables, k_cache.shape[1], seq_lens.tolist(), starts.tolist(), 8)
    assert plan.num_decodes == sum(q_len for _, q_len in specs if q_len <= 8) and len(plan.prefills) == 1
    torch.testing.assert_close(paged_attention(*batch, 0.3, backend="cpu", plan=plan), ref, **TOL)
    torch.testing.assert_close(paged_attention_torch(*batch, 0.3, plan=plan), ref, **TOL)


def test_long_contexts_large_scores_and_threads():
    """2,000-token contexts with scores in the hundreds (softmax must subtract its maximum), on one thread
    and on two: the same numbers as the reference (scores that large magnify expf's last-bit differences
    about tenfold, hence a looser tolerance)."""
    specs = [(2000, 1), (1999, 1), (17, 1), (1, 1)]
    q, k_cache, v_cache, tables, seq_lens, starts = make_batch(specs, block_size=16, group=3, head_dim=64, seed=5)
    q = q * 30
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, 0.125)
    padded = tables.long().clamp(min=0)        # the kernel reads any valid id past a request's end
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = paged_decode_attention_cpu(q, k_cache, v_cache, padded, seq_lens, 0.125)
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


def test_queries_may_be_a_view_of_a_wider_tensor():
    """The model hands over q as the first heads of its q|k rows (a strided view): read in place, the same
    result as a contiguous copy; anything else (a half-precision or transposed q) is refused or copied."""
    q, k_cache, v_cache, tables, seq_lens, starts = make_batch([(30, 1), (9, 1), (50, 1)], group=3, seed=4)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, 0.2)
    wide = torch.cat([q, torch.randn(3, 2, q.shape[-1])], dim=1)            # [reqs, heads + 2, dim]
    view = wide[:, :q.shape[1]]
    assert not view.is_contiguous()
    padded = tables.long().clamp(min=0)
    torch.testing.assert_close(paged_decode_attention_cpu(view, k_cache, v_cache, padded, seq_lens, 0.2), ref, **TOL)
    transposed = q.transpose(1, 2).contiguous().transpose(1, 2)             # heads not end to end: copied
    torch.testing.assert_close(paged_decode_attention_cpu(transposed, k_cache, v_cache, padded, seq_lens, 0.2), ref,
                               **TOL)
    with pytest.raises(ValueError, match="float32 CPU tensors"):
        paged_decode_attention_cpu(q.half(), k_cache, v_cache, padded, seq_lens, 0.2)


def test_bad_indices_raise_instead_of_reading_outside_the_cache():
    q, k_cache, v_cache, tables, seq_lens, _ = make_batch([(20, 1), (5, 1)], block_size=16, seed=1)
    good = tables.long().clamp(min=0)
    out = paged_decode_attention_cpu(q, k_cache, v_cache, good, seq_lens, 0.25)
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="block ids must be 0.."):
        paged_decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, 0.25)           # -1 padding
    with pytest.raises(ValueError, match="block ids must be 0.."):
        paged_decode_attention_cpu(q, k_cache, v_cache, good + k_cache.shape[0], seq_lens, 0.25)
    with pytest.raises(ValueError, match="decode lengths must be 1.."):
        paged_decode_attention_cpu(q, k_cache, v_cache, good, seq_lens * 100, 0.25)     # past the table
    with pytest.raises(ValueError, match="decode lengths must be 1.."):
        paged_decode_attention_cpu(q, k_cache, v_cache, good, seq_lens * 0, 0.25)


def test_the_engine_uses_it_and_greedy_tokens_do_not_change(tiny_engine_factory):
    """The engine picks the kernel on a CPU in float32; a workload with decodes beside prefill chunks and
    preemptions gives the same greedy tokens as the torch path."""
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 60))] for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for backend in (None, "torch"):
        engine = tiny_engine_factory(num_blocks=24, block_size=4, max_num_batched_tokens=32,
                                     attention_backend=backend)
        results[engine.backend.name] = [o.token_ids for o in engine.generate(prompts, params)]
        if backend is None:
            assert engine.backend.name == "cpu" and engine.stats()["preemptions_recompute"] > 0
    assert results["cpu"] == results["torch"]


def test_a_step_builds_the_kernel_only_for_the_models_head_size(monkeypatch):
    """Planning a step and writing its K/V are torch code for the cpu backend too: they must not ask for
    (and so compile) a kernel of some other head size; attending asks for the queries' own."""
    import kernel_dispatch as kernels
    asked: list[int] = []
    real = kernels.cpu_kernel_available

    def recording(head_dim: int = 64) -> bool:
        asked.append(head_dim)
        return real(head_dim)
    monkeypatch.setattr(kernels, "cpu_kernel_available", recording)
    q, k_cache, v_cache, tables, seq_lens, starts = make_batch([(9, 1), (30, 1), (12, 4)], block_size=4,
                                                               head_dim=32, seed=5)
    tables = tables.long().clamp(min=0)
    hints = plan_attention(tables, 4, seq_lens.tolist(), starts.tolist(), backend="cpu")
    new_k = torch.randn(6, k_cache.shape[2], 32)
    kernels.write_kv(new_k, new_k.clone(), k_cache, v_cache, torch.arange(6), backend="cpu")
    out = paged_attention(q, k_cache, v_cache, tables, seq_lens, starts, 0.2, backend="cpu", **hints)
    want = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, starts, 0.2)
    torch.testing.assert_close(out, want, **TOL)
    assert asked and set(asked) == {32}


def test_compiled_linear_matches_torch_and_leaves_the_rest_to_it():
    """The compiled loops (the one-row loop up to PER_ROW_ROWS token rows, the tiled multiply beyond) give
    F.linear's values to rounding, for widths that are and are not multiples of a vector and for row counts that
    do and do not fill a tile; other dtypes, strided weights and empty inputs go to torch itself."""
    import torch.nn.functional as F
    from minipaged.kernels import PER_ROW_ROWS, compiled_linear
    linear = compiled_linear(64)
    gen = torch.Generator().manual_seed(4)
    for rows in (*range(1, 10), 16, 33):
        for out_features, in_features in ((1, 7), (3, 20), (33, 64), (1000, 577)):
            x = torch.randn(rows, in_features, generator=gen)
            weight = torch.randn(out_features, in_features, generator=gen)
            assert linear.handles(x, weight)
            # sums of up to 577 products of numbers near 1, in another order: rounding differs by ~1e-5
            torch.testing.assert_close(linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
    assert PER_ROW_ROWS < 9                                  # both loops were exercised above
    # Up to PER_ROW_ROWS rows, a row's result does not depend on the rows beside it, to the bit: a verification's
    # rows get the numbers a decode of each gets (cpu_matvec.c).
    x, weight = torch.randn(PER_ROW_ROWS, 577, generator=gen), torch.randn(50, 577, generator=gen)
    for rows in range(1, PER_ROW_ROWS + 1):
        together = linear(x[:rows], weight)
        assert all(torch.equal(together[b], linear(x[b:b + 1], weight)[0]) for b in range(rows)), rows
    # Past them, the tiled multiply: a token row in the last, ragged group of 1-3 gets the bits it gets in a full
    # group of four (the same sums in the same order, every weight row of a tile at once either way).
    x, weight = torch.randn(12, 577, generator=gen), torch.randn(50, 577, generator=gen)
    full = linear(x, weight)
    for rows in (9, 10, 11):
        assert torch.equal(linear(x[:rows], weight), full[:rows]), rows
    x, weight = torch.randn(PER_ROW_ROWS + 3, 64, generator=gen), torch.randn(40, 64, generator=gen)
    strided = torch.randn(64, 40, generator=gen).t()
    for args in ((x[:2].bfloat16(), weight.bfloat16()), (x[:2], strided), (x, strided), (x[:0], weight)):
        assert not linear.handles(*args)
        assert torch.equal(linear(*args), F.linear(*args))
    # A strided x is copied first (the loops read rows end to end), and gives the same values.
    for cols in (3, PER_ROW_ROWS + 5):
        x_strided = torch.randn(64, cols, generator=gen).t()
        torch.testing.assert_close(linear(x_strided, weight), F.linear(x_strided, weight), rtol=1e-5, atol=1e-4)
    # Widths that disagree are torch's to refuse: the loop would read past the end of a narrower x.
    for bad_x in (torch.randn(2, 63), torch.randn(2, 65), torch.randn(9, 63)):
        assert not linear.handles(bad_x, weight)
        with pytest.raises(RuntimeError):
            linear(bad_x, weight)
    assert not linear.handles(x[:2], weight[0])            # a 1-D weight: torch's own (vector) semantics
    assert torch.equal(linear(x[:2], weight[0]), F.linear(x[:2], weight[0]))


def test_asking_for_it_where_it_cannot_run_says_what_to_do(tiny_model):
    with pytest.raises(ConfigError, match="runs on the CPU in float32.*attention_backend='torch'"):
        Engine(tiny_model, attention_backend="cpu", dtype="bfloat16", num_blocks=16)


def test_without_a_compiler_the_engine_falls_back_to_torch(tiny_model, tmp_path):
    """No C compiler (CC names none) and an empty kernel cache: the engine runs on the torch path, and asking
    for the kernel explains why it is missing."""
    script = f"""
import sys
from minipaged import Engine, SamplingParams
from minipaged.config import ConfigError
from minipaged.kernels import cpu_kernel_problem
print("problem:", cpu_kernel_problem(16))
engine = Engine({tiny_model!r}, num_blocks=16, block_size=4, load_progress=print)
assert engine.backend.name == "torch", engine.backend
out = engine.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
assert len(out[0].token_ids) == 3
try:
    Engine({tiny_model!r}, num_blocks=16, attention_backend="cpu")
except ConfigError as e:
    print("asked:", e)
"""
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "MINIPAGED_CACHE": str(tmp_path / "cache"),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "problem: could not run the C compiler" in done.stdout
    assert "Attention: torch, torch ops (the compiled CPU kernel is unavailable: could not run" in done.stdout
    assert "asked: the cpu attention backend is unavailable here" in done.stdout
    assert "use attention_backend='torch'" in done.stdout


def test_the_profiler_sees_the_kernel_by_name():
    """bench/decode_floor.py splits a profiled step by operator: the C calls must show up as ones."""
    from torch.profiler import ProfilerActivity, profile
    q, k_cache, v_cache, tables, seq_lens, _ = make_batch([(20, 1), (5, 1)], block_size=16, seed=2)
    from minipaged.kernels import CpuArgmax, compiled_linear, cpu_layer_ops
    ops = cpu_layer_ops(16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        paged_decode_attention_cpu(q, k_cache, v_cache, tables.long().clamp(min=0), seq_lens, 0.25)
        compiled_linear(16)(torch.randn(2, 16), torch.randn(5, 16))
        compiled_linear(16)(torch.randn(9, 16), torch.randn(5, 16))
        ops.add_rms_norm(torch.randn(2, 16), None, torch.ones(16), 1e-5)
        ops.rope_and_write_kv(torch.randn(1, 6 * 16), torch.ones(1, 16), torch.zeros(1, 16), k_cache, v_cache,
                              torch.tensor([-1]), 2, 2)                 # 2 query heads, the caches' 2 KV heads
        ops.silu_and_mul(torch.randn(2, 8))
        CpuArgmax(16)(torch.randn(2, 50))
    names = {op.key for op in prof.key_averages()}
    assert {"minipaged::paged_decode_attention_cpu", "minipaged::small_batch_linear", "minipaged::tiled_linear",
            "minipaged::add_rms_norm",
            "minipaged::rope_and_write_kv", "minipaged::silu_and_mul", "minipaged::argmax_rows"} <= names


def test_a_damaged_cached_kernel_is_rebuilt_and_an_unwritable_cache_is_explained(tmp_path, monkeypatch):
    from minipaged.kernels import cpu_paged_attention as cpu
    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    cpu.load_kernel.cache_clear()
    try:
        built = cpu._build(32)
        built.write_bytes(b"not a shared library")                 # as if a copy had been cut short
        cpu.load_kernel(32)                                         # rebuilt, loads
        assert built.read_bytes() != b"not a shared library"
        cpu.load_kernel.cache_clear()
        blocker = tmp_path / "file"
        blocker.write_text("a file where the cache folder should be")
        monkeypatch.setenv("MINIPAGED_CACHE", str(blocker))
        with pytest.raises(cpu.CpuKernelUnavailable, match="set MINIPAGED_CACHE to a writable folder"):
            cpu.load_kernel(32)
    finally:
        cpu.load_kernel.cache_clear()
