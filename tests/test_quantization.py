"""Weight-only int8 (``quantization="int8"``): the arithmetic, the engine's logits against fp32, refusals,
memory accounting. SmolLM2's greedy agreement with fp32 is measured in the slow test at the end."""
from __future__ import annotations

import random

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.config import ConfigError
from minipaged.kernels.int8 import Int8Linear, Int8Weight, int8_linear_torch, quantize_int8
from tests.conftest import random_prompts
from tests.test_model_families import family_model  # noqa: F401  (a fixture)
from tests.test_model_vs_transformers import run_and_capture_logits

# The tiny models' int8 logits against their fp32 logits on the same tokens, as a share of the largest fp32
# logit: measured 4% (tied, 2 layers) and 10% (untied, 3 layers). Their random weights are drawn wide
# (initializer_range 0.2, to make greedy winners clear), which makes every rounding count more than in a
# trained model; SmolLM2's agreement is measured by the slow test below and bench/quantization.py.
TINY_FP32_RTOL = 0.12


def test_quantize_int8_rounds_each_weight_to_its_rows_nearest_step():
    torch.manual_seed(0)
    w = torch.randn(37, 70) * torch.linspace(0.01, 3.0, 37)[:, None]     # rows of very different ranges
    w[5] = 0.0                                                           # an all-zero row
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.shape == w.shape
    assert q.qweight.abs().max() == 127                                  # each row's largest weight hits +-127
    assert torch.equal(q.qweight[5], torch.zeros(70, dtype=torch.int8)) and q.scale[5] == 1.0
    error = (q.dequantize() - w).abs()
    assert (error <= q.scale[:, None] / 2 + 1e-7).all()                  # half a step at most, per row
    assert q.nbytes == 37 * 70 + 37 * 4


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 33])
@pytest.mark.parametrize("compiled,tiled_many_rows,fixed_point", [(True, True, True), (True, True, False),
                                                                   (True, False, True), (False, False, False)],
                         ids=["cpu-backend-tiled", "cpu-backend-widening-one-row", "cpu-backend-widened",
                              "torch-backend"])
def test_int8_linear_is_the_dequantized_matmul(rows, compiled, tiled_many_rows, fixed_point):
    """Every path (the two one-row int8 loops, the tiled multiply, torch on widened slices) computes
    x @ dequantize(q).T; output rows that do not fill a tile and columns not a multiple of the vector width
    included."""
    torch.manual_seed(rows)
    w, x = torch.randn(301, 611), torch.randn(rows, 611)
    q = quantize_int8(w)
    linear = Int8Linear(torch.nn.functional.linear, head_dim=16, compiled=compiled, tiled_many_rows=tiled_many_rows,
                        fixed_point=fixed_point)
    expected = x @ q.dequantize().T
    torch.testing.assert_close(linear(x, q), expected, atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(int8_linear_torch(x, q), expected, atol=2e-4, rtol=1e-4)
    plain = torch.randn(5, 611)                                          # a float weight takes the base path
    assert torch.equal(linear(x, plain), torch.nn.functional.linear(x, plain))


def one_row_loop(name: str, x: torch.Tensor, q: Int8Weight) -> torch.Tensor:
    from minipaged.kernels.build import load_kernel
    out = torch.empty(x.shape[0], q.shape[0])
    getattr(load_kernel(16), name)(q.qweight.data_ptr(), q.scale.data_ptr(), x.data_ptr(), out.data_ptr(),
                                   x.shape[0], q.shape[0], q.shape[1], 1)
    return out


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("cols", [64, 611, 5000])          # 5000: summed in chunks (CHUNK_COLS in the C file)
def test_the_fixed_point_loop_is_as_close_to_the_exact_product_as_float_math(rows, cols):
    """The fixed-point one-row loop writes the activations as two int16 planes (2^-31 of the row's largest value):
    against the exact product (float64), its error is no larger than the widening loop's, which multiplies in
    float32, for activations spanning seven orders of magnitude; and the largest weights against the largest
    activations, summed over many columns, do not overflow its int32 sums."""
    torch.manual_seed(cols + rows)
    q = quantize_int8(torch.randn(37, cols))
    x = torch.randn(rows, cols) * 10.0 ** torch.randint(-5, 3, (rows, cols))       # 1e-5 .. 1e2
    exact = (x.double() @ q.dequantize(torch.float64).T)
    errors = {name: (one_row_loop(name, x, q).double() - exact).abs().max().item()
              for name in ("int8_fixed_point_linear", "int8_small_batch_linear")}
    scale = exact.abs().max().item()
    assert errors["int8_fixed_point_linear"] <= max(1.5 * errors["int8_small_batch_linear"], 1e-6 * scale), errors
    worst = Int8Weight(torch.full((3, cols), 127, dtype=torch.int8), torch.ones(3))
    worst.qweight[1] = -127
    big = torch.full((rows, cols), 3.0e4)
    torch.testing.assert_close(one_row_loop("int8_fixed_point_linear", big, worst),
                               torch.tensor([[127 * 3.0e4 * cols, -127 * 3.0e4 * cols, 127 * 3.0e4 * cols]] * rows),
                               rtol=1e-6, atol=0)


def test_the_fixed_point_loop_passes_inf_and_nan_through_and_zeros_to_zero():
    """A row that is not finite cannot be written in fixed point: it goes to float math, which says what it is
    (the library is compiled with -ffast-math, so the C file tests the exponent bits, not isfinite)."""
    q = quantize_int8(torch.randn(9, 70))
    x = torch.randn(3, 70)
    x[0, 5], x[1, 6], x[2] = float("nan"), float("inf"), 0.0
    out = one_row_loop("int8_fixed_point_linear", x, q)
    assert out[0].isnan().all() and not out[1].isfinite().any() and torch.equal(out[2], torch.zeros(9))


def check_int8_logits(path: str, options: dict, attention_backend) -> None:
    """Teacher-forced on the int8 engine's own greedy tokens: its logits are exactly (to float rounding) those of
    the fp32 model whose weights are the dequantized int8 values, and within TINY_FP32_RTOL of the fp32 model's.
    A batch decoded together (many rows: the widening path) and a request alone (the compiled loop)."""
    from minipaged.model import load_model
    from minipaged.model.int8_reference import dequantized_hf_model
    hf = load_model(path).hf_model
    engine = Engine(path, block_size=4, num_blocks=128, quantization="int8", attention_backend=attention_backend,
                    **options)
    assert isinstance(engine.model.layers[0].qkv, Int8Weight) and isinstance(engine.model.lm_head, Int8Weight)
    dequantized = dequantized_hf_model(hf, engine.model)
    for prompts in (random_prompts(random.Random(7), 9, 3, 29), random_prompts(random.Random(8), 1, 5, 6)):
        outs, captured, _ = run_and_capture_logits(engine, prompts, max_tokens=6)
        worst = scale = 0.0
        for out in outs:
            full = torch.tensor([out.prompt_token_ids + out.token_ids])
            n_prompt = len(out.prompt_token_ids)
            ours = torch.stack(captured[out.request_id])
            with torch.no_grad():
                same_weights = dequantized(full).logits[0, n_prompt - 1:-1].float()
                fp32 = hf(full).logits[0, n_prompt - 1:-1].float()
            torch.testing.assert_close(ours, same_weights, atol=1e-4, rtol=1e-4)
            worst = max(worst, float((ours - fp32).abs().max()))
            scale = max(scale, float(fp32.abs().max()))
        assert 0 < worst <= TINY_FP32_RTOL * scale, (worst, scale)          # not exact, and not far


@pytest.mark.parametrize("attention_backend", [None, "torch"], ids=["cpu-backend", "torch-backend"])
@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_model_untied"])
def test_int8_logits_are_the_dequantized_models_and_near_fp32(fixture, attention_backend, request):
    check_int8_logits(request.getfixturevalue(fixture), {}, attention_backend)


@pytest.mark.parametrize("name", ["qwen2-gqa-tied", "qwen3-gqa-untied", "mistral-gqa-untied"])
def test_int8_runs_every_family_with_its_extra_weights_in_fp32(family_model, name):
    """Qwen2's q/k/v biases and Qwen3's q/k norms stay fp32 beside the int8 matrices."""
    check_int8_logits(*family_model(name), None)


def test_refusals_name_the_problem_and_the_fix(tiny_model):
    with pytest.raises(ConfigError, match="quantization must be 'int8'"):
        Engine(tiny_model, quantization="int4")
    with pytest.raises(ConfigError, match="tensor or pipeline parallelism.*tensor_parallel_size=1"):
        Engine(tiny_model, quantization="int8", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="dtype='float32'"):
        Engine(tiny_model, quantization="int8", dtype="bfloat16", num_blocks=16)


def test_the_triton_backend_refuses_int8_clearly(tiny_model, monkeypatch):
    import minipaged.engine_builder as builder_module
    from minipaged.kernels import TritonBackend
    monkeypatch.setattr(builder_module, "select_backend", lambda *args, **kw: TritonBackend())
    with pytest.raises(ConfigError, match="no Triton kernel.*attention_backend='torch'"):
        Engine(tiny_model, quantization="int8", num_blocks=16)


def test_memory_accounting_and_the_start_up_line(tiny_model_untied):
    lines: list[str] = []
    fp32 = Engine(tiny_model_untied, num_blocks=16, load_progress=lines.append)
    int8 = Engine(tiny_model_untied, num_blocks=16, quantization="int8", load_progress=lines.append)
    m = fp32.model
    matrices = [t for w in m.layers for t in (w.qkv, w.o, w.gate_up, w.down)] + [m.lm_head]
    floats = [m.embed, m.final_norm] + [t for w in m.layers for t in (w.input_norm, w.post_norm)]
    assert fp32.model.weight_bytes() == 4 * sum(t.numel() for t in matrices + floats)
    # int8: one byte a matrix weight and four per output row; the embedding and norms stay fp32.
    assert int8.model.weight_bytes() == (sum(t.numel() + 4 * t.shape[0] for t in matrices)
                                         + 4 * sum(t.numel() for t in floats))
    assert int8.loaded.hf_model is None                     # the fp32 copies are not kept beside the int8 ones
    weights = [line for line in lines if line.startswith("Weights: ")]
    assert weights[0] == f"Weights: {fp32.model.weight_bytes() / 2**20:.1f} MiB (float32)"
    assert weights[1].startswith(f"Weights: {int8.model.weight_bytes() / 2**20:.1f} MiB (int8")
    kv = [i for i, line in enumerate(lines) if line.startswith("KV cache")]
    assert lines.index(weights[0]) == kv[0] + 1            # beside the KV cache's line


def test_int8_with_a_self_draft_and_prefix_caching_generates(tiny_model):
    """The int8 layers are shared with a self-draft and reused across steps: generation runs to the end."""
    engine = Engine(tiny_model, block_size=4, num_blocks=64, quantization="int8",
                    speculative_config={"method": "draft_model", "model": "self", "num_speculative_tokens": 2,
                                        "num_draft_layers": 1})
    outs = engine.generate([[1, 2, 3, 4, 5]] * 2, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) == 8


# SmolLM2's greedy agreement with fp32, teacher-forced, over the held-out chat prompts below: measured
# (bench/quantization.py's prompts and lengths, bench/out/quantization.json), and held to this floor.
SMOLLM2_TEACHER_FORCED_FLOOR = 0.93      # measured 0.961 (bench/out/quantization.json)
SMOLLM2_PREFIX_FLOOR = 0.35              # measured 0.490: one near-tie decides the rest of an answer


@pytest.mark.slow
def test_smollm2_int8_agrees_with_fp32_on_held_out_chat_prompts():
    from minipaged.bench.quality import greedy_agreement
    from minipaged.model.int8_reference import dequantized_hf_model
    from minipaged.workloads import OPEN_ENDED
    options = dict(num_threads=1, kv_cache_memory=0.25, max_model_len=1024)
    fp32 = Engine("smollm2", **options)
    int8 = Engine("smollm2", quantization="int8", **options)
    # SmolLM2's LM head is its embedding (tied): fp32 counts the 113 MB once; int8 keeps it fp32 for the lookup
    # and adds an int8 copy for the head, so its weights are 0.46 of fp32's rather than a quarter.
    assert int8.model.weight_bytes() < 0.5 * fp32.model.weight_bytes()
    prompts = [fp32.inputs.chat_prompt([{"role": "user", "content": p}]) for p in OPEN_ENDED[-8:]]
    agreement = greedy_agreement(fp32, int8, dequantized_hf_model(fp32.loaded.hf_model, int8.model), prompts, 48)
    assert agreement.tokens >= 8 * 24
    assert agreement.teacher_forced >= SMOLLM2_TEACHER_FORCED_FLOOR, agreement
    assert agreement.prefix_agreement >= SMOLLM2_PREFIX_FLOOR, agreement
    assert agreement.teacher_forced < 1.0 or agreement.identical_outputs == agreement.prompts


def test_quantization_md_is_its_template_filled_from_the_json():
    from minipaged.bench.docs import QUANTIZATION_DOC, QUANTIZATION_TEMPLATE, bench_results, rendered_quantization_doc
    from minipaged.placeholders import hand_written_numbers
    from tests.test_docs import ALLOWED
    assert QUANTIZATION_DOC.read_text(encoding="utf-8") == rendered_quantization_doc(bench_results()), (
        "docs/quantization.md is not docs/quantization.md.in filled from bench/out/quantization.json: run "
        "python bench/render_docs.py")
    typed = hand_written_numbers(QUANTIZATION_TEMPLATE.read_text(encoding="utf-8"),
                                 ALLOWED + [r"8\+ row int8 matmuls", r"\bint8\b", r"\bFP8\b", r"\bINT8\b",
                                            r"\bfloat32\b", r"\bQ\d_\d\b", r"\bF32\b"])
    assert not typed, f"numbers typed into docs/quantization.md.in instead of placeholders: {typed}"


def test_peer_llamacpp_finds_llama_server_or_skips_with_a_message(tmp_path, monkeypatch, capsys):
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import peer_llamacpp
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert peer_llamacpp.find_llama_cpp(str(tmp_path)) is None
    build = tmp_path / "llama.cpp" / "build"
    (build / "bin").mkdir(parents=True)
    for name in ("llama-server", "llama-quantize"):
        (build / "bin" / name).write_text("")
    assert peer_llamacpp.find_llama_cpp(str(tmp_path / "llama.cpp")) == build          # a source folder's build/
    monkeypatch.setenv("LLAMA_CPP_DIR", str(build))
    assert peer_llamacpp.find_llama_cpp(None) == build
    monkeypatch.delenv("LLAMA_CPP_DIR")
    monkeypatch.setattr("sys.argv", ["peer_llamacpp.py", "--llama-cpp-dir", str(tmp_path / "nowhere")])
    assert peer_llamacpp.main() == 0
    assert "SKIPPED: llama-server and llama-quantize not found" in capsys.readouterr().out


def test_peer_llamacpp_reads_llama_servers_own_timing_and_states_the_targets_as_ratios(tmp_path, monkeypatch):
    """The comparison's cross-check and verdicts: llama-server's own per-token decode time is read from its log
    (full-length requests of the alone phase only), and the targets are ratios of the measured rates, the
    loaded one against whichever llama.cpp server was fastest."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import peer_llamacpp
    log = tmp_path / "llama.log"
    log.write_text("slot print_timing: id 15 | task 0 |        eval time =      18.87 ms /     4 tokens (...)\n"
                   "slot print_timing: id 14 | task 5 |        eval time =     480.00 ms /    64 tokens (...)\n"
                   "slot print_timing: id 13 | task 6 | prompt eval time =  186.80 ms /    95 tokens (...)\n"
                   "slot print_timing: id 13 | task 70 |        eval time =     448.00 ms /    64 tokens (...)\n"
                   "slot print_timing: id 12 | task 71 |        eval time =     999.00 ms /    64 tokens (...)\n")
    assert peer_llamacpp.llama_own_decode_ms(log, requests=2, output_len=64) == pytest.approx((7.5 + 7.0) / 2)
    assert peer_llamacpp.llama_own_decode_ms(log, requests=2, output_len=32) is None

    def rates(alone, loaded):
        return {"alone": {"output_tok_s": alone}, "loaded": {"output_tok_s": loaded}}
    results = {"minipaged-fp32": rates(40.0, 150.0), "minipaged-int8": rates(80.0, 180.0),
               "llama.cpp-F32": rates(50.0, 120.0), "llama.cpp-Q8_0": rates(100.0, 160.0),
               "llama.cpp-Q4_1": rates(75.0, 90.0)}
    ratios = peer_llamacpp.ratios(results)
    assert ratios["alone_fp32_vs_f32"] == pytest.approx(0.8)
    assert ratios["alone_int8_vs_q8_0"] == pytest.approx(0.8)
    assert ratios["loaded_best_llama_cpp"] == "llama.cpp-Q8_0"
    assert ratios["loaded_fp32_vs_best"] == pytest.approx(150 / 160)
    assert ratios["loaded_int8_vs_best"] == pytest.approx(180 / 160)
    assert peer_llamacpp.ratios({"minipaged-int8": rates(80.0, 180.0)}) == {}       # a smoke run: no peers


def test_peer_llamacpp_takes_each_servers_median_over_its_rounds(tmp_path, monkeypatch):
    """Servers take turns over several rounds (the machine is noisy): each figure is the median of the rounds,
    a figure every round shares (how many requests) stays as it is, and each round's rate is kept."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import peer_llamacpp

    def run(alone, loaded, own=None):
        return {"alone": {"requests": 4, "output_tok_s": alone, "own_decode_ms": own},
                "loaded": {"requests": 32, "output_tok_s": loaded}}
    rounds = [{"minipaged-fp32": run(50.0, 170.0), "llama.cpp-F32": run(55.0, 150.0, 15.0)},
              {"minipaged-fp32": run(56.0, 160.0), "llama.cpp-F32": run(50.0, 155.0, None)},
              {"minipaged-fp32": run(53.0, 180.0), "llama.cpp-F32": run(54.0, 140.0, 16.0)}]
    combined = peer_llamacpp.median_over_rounds(rounds)
    assert combined["minipaged-fp32"]["alone"] == {"requests": 4, "output_tok_s": 53.0, "own_decode_ms": None}
    assert combined["minipaged-fp32"]["loaded"]["output_tok_s"] == 170.0
    assert combined["llama.cpp-F32"]["alone"]["own_decode_ms"] == 15.5             # of the rounds that had it
    assert combined["llama.cpp-F32"]["rounds_output_tok_s"]["alone"] == [55.0, 50.0, 54.0]
    assert peer_llamacpp.ratios(combined)["alone_fp32_vs_f32"] == pytest.approx(53 / 54)


def test_int8_keeps_no_view_of_the_loaded_checkpoint(tiny_model_untied, monkeypatch):
    """transformers' tensors may be views of one memory-mapped checkpoint file, resident while any view lives:
    the fp32 tensors int8 keeps (embedding, norms) are copies, so dropping transformers' model frees it all."""
    import minipaged.engine_builder as builder_module
    loaded = []
    load = builder_module.load_model
    monkeypatch.setattr(builder_module, "load_model", lambda *a, **kw: loaded.append(load(*a, **kw)) or loaded[-1])
    engine = Engine(tiny_model_untied, num_blocks=16, quantization="int8")
    theirs = {t.untyped_storage().data_ptr() for t in loaded[0].hf_model.state_dict().values()}
    m = engine.model
    ours = [m.embed, m.final_norm] + [t for w in m.layers for t in (w.input_norm, w.post_norm)]
    assert not theirs & {t.untyped_storage().data_ptr() for t in ours}


def test_the_backend_owns_the_int8_product_and_never_relays_int8_weights(tiny_model, monkeypatch):
    """Each backend's ``linear`` and ``lm_head`` take an ``Int8Weight``; a cpu calibration that stores fp32
    weights [in, out] leaves int8 ones [out, in] (what the int8 loop reads), and the start-up line names the loop."""
    import minipaged.engine_builder as builder_module
    from minipaged.kernels import CpuBackend, CpuChoice, TorchBackend
    from minipaged.kernels.backends.calibration import IN_OUT
    torch.manual_seed(3)
    q = quantize_int8(torch.randn(40, 32))
    relaying = lambda head_dim=16: CpuBackend(head_dim, CpuChoice(few_row_linear=IN_OUT))      # noqa: E731
    for backend in (TorchBackend(), relaying()):
        assert backend.prepare_weight(q) is q
        for rows in (1, 5, 9):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(backend.linear(x, q), x @ q.dequantize().T, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(backend.lm_head(x, q), x @ q.dequantize().T, atol=2e-4, rtol=1e-4)
    monkeypatch.setattr(builder_module, "select_backend", lambda device, dtype, shapes, *a, **kw: relaying(shapes.head_dim))
    lines: list[str] = []
    engine = Engine(tiny_model, block_size=4, num_blocks=32, quantization="int8", load_progress=lines.append)
    for w in engine.model.layers:
        assert all(isinstance(m, Int8Weight) and m.qweight.is_contiguous() for m in (w.qkv, w.o, w.gate_up, w.down))
    attention = [line for line in lines if line.startswith("Attention: ")]
    assert "cpu_int8_matvec.c" in attention[0]
    outs = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4
