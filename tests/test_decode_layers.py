"""The layer loop as one compiled call for decode steps (kernels/cpu_decode_layers.c, the cpu backend's
``decode_layers``): it must compute exactly what the model's own loop computes with the same compiled kernels (the
logits bit for bit, fp32 and int8), run for every decode step it covers, and leave the rest (prefill chunks,
families whose layers it does not have, a profiler recording) to the loop."""
from __future__ import annotations

import pickle

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.kernels import cpu_decode_layers
from tests.test_model_families import family_model  # noqa: F401  (a fixture)

PARAMS = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


def generate_capturing(engine: Engine, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor], list]:
    """Greedy tokens, every step's logits, and what each decode_layers call answered (None: the loop ran)."""
    logits, answers = [], []
    final_logits, decode_layers = engine.model.final_logits, engine.backend.decode_layers

    def capture_logits(*args, **kwargs):
        out = final_logits(*args, **kwargs)
        logits.append(out.clone())
        return out

    def capture_answer(*args, **kwargs):
        answer = decode_layers(*args, **kwargs)
        answers.append((args[1].shape[0], answer is not None))
        return answer
    engine.model.final_logits, engine.backend.decode_layers = capture_logits, capture_answer
    try:
        tokens = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    finally:
        engine.model.final_logits, engine.backend.decode_layers = final_logits, decode_layers
    return tokens, logits, answers


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["fp32", "int8"])
@pytest.mark.parametrize("num_prompts", [1, 3, 7])
def test_decode_steps_run_as_one_call_and_give_the_loops_logits_bit_for_bit(tiny_model_untied, quantization,
                                                                             num_prompts):
    """One, three and seven requests decoding together (the one-row loops, and the tiled multiply for more rows),
    fp32 and int8: every decode step runs as one compiled call, every prefill runs the loop, and the logits equal
    those of the same engine with the compiled call switched off, to the bit."""
    # (prompts of nine tokens or more: a chunk of up to eight rows attends as decodes, and may run as one call)
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(9 + i)] for i in range(num_prompts)]
    options = dict(block_size=4, num_blocks=128, max_num_seqs=8, enable_prefix_caching=False)
    engine = Engine(tiny_model_untied, quantization=quantization, **options)
    assert engine.backend._decode_layers is not None
    assert "the layer loop as one call" in engine.backend.describe()        # (the start-up line says so)
    tokens, logits, answers = generate_capturing(engine, prompts)
    assert any(ran for _rows, ran in answers), answers
    decode_rows = {rows for rows, ran in answers if ran}
    assert decode_rows and max(decode_rows) <= num_prompts               # decodes: one row a request
    assert not any(ran for rows, ran in answers if rows > num_prompts)   # a prefill: the loop

    engine.backend._decode_layers = None                                 # the Python loop, same kernels
    loop_tokens, loop_logits, loop_answers = generate_capturing(engine, prompts)
    assert not any(ran for _rows, ran in loop_answers)
    assert tokens == loop_tokens
    assert len(logits) == len(loop_logits) and all(torch.equal(a, b) for a, b in zip(logits, loop_logits))


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.mark.parametrize("quantization", [None, "int8"], ids=["fp32", "int8"])
@pytest.mark.parametrize("num_prompts, k", [(1, 3), (1, 6), (2, 2)])
def test_verification_steps_run_as_one_call_and_give_the_loops_logits_bit_for_bit(tiny_model_untied, quantization,
                                                                                  num_prompts, k):
    """A speculative verification's k + 1 rows (one request, or two verifying together, up to seven rows) are a
    decode step: each row attends as a decode that sees its context up to itself, so the step runs as one compiled
    call, with the logits of the Python loop over the same kernels to the bit, and the tokens of no speculation."""
    prompts = [[(5 * i + j) % 7 + 1 for j in range(12 + i)] for i in range(num_prompts)]    # they repeat: drafts
    options = dict(block_size=4, num_blocks=128, max_num_seqs=8, enable_prefix_caching=False,
                   quantization=quantization)
    engine = Engine(tiny_model_untied, speculative_config={**NGRAM, "num_speculative_tokens": k}, **options)
    verifications, produced = [], []
    engine.subscribe(lambda event: verifications.extend(s for s in event.scheduled if s.draft_token_ids))
    engine.subscribe(lambda event: produced.append(sum(map(len, event.new_token_ids.values()))))
    tokens, logits, answers = generate_capturing(engine, prompts)
    assert verifications, "no step verified drafts: the test proves nothing"
    assert any(ran and rows > num_prompts for rows, ran in answers), answers        # a verification, compiled
    assert all(ran for rows, ran in answers if rows <= 7 and rows < 12)              # every step but the prompts

    engine.backend._decode_layers = None                                 # the Python loop, same kernels
    loop_tokens, loop_logits, _answers = generate_capturing(engine, prompts)
    assert tokens == loop_tokens
    assert len(logits) == len(loop_logits) and all(torch.equal(a, b) for a, b in zip(logits, loop_logits))
    plain = Engine(tiny_model_untied, **options)
    plain_tokens, plain_logits, _answers = generate_capturing(plain, prompts)
    assert plain_tokens == tokens
    if num_prompts == 1 and quantization is None:
        # fp32: each kept row of a verification is, to the bit, the row a plain decode of that token computes
        # (the few-row matmul's rows do not depend on each other, and every row attends as a decode)
        plain_rows = [row for step in plain_logits for row in step]
        kept_rows = [row for step, n in zip(logits, produced) for row in step[:n]]
        assert len(kept_rows) == len(plain_rows) == PARAMS.max_tokens
        assert all(torch.equal(a, b) for a, b in zip(kept_rows, plain_rows))


def test_families_with_biases_or_qk_norms_run_the_loop(family_model):
    """Qwen2's q/k/v biases and Qwen3's q/k norms are not in the C loop: those models' decodes run the Python
    loop (and still generate)."""
    for name in ("qwen2-gqa-tied", "qwen3-gqa-untied"):
        path, options = family_model(name)
        engine = Engine(path, block_size=4, num_blocks=64, **options)
        tokens, _logits, answers = generate_capturing(engine, [[1, 2, 3]])
        assert answers and not any(ran for _rows, ran in answers) and len(tokens[0]) == PARAMS.max_tokens


def test_a_profiler_sees_the_loops_parts(tiny_model):
    """While torch.profiler records, decode steps run the loop, so that a profile shows each kernel (the compiled
    call would be one opaque operator)."""
    engine = Engine(tiny_model, block_size=4, num_blocks=64)
    with torch.profiler.profile() as profile:
        _tokens, _logits, answers = generate_capturing(engine, [[5, 6, 7]])
    assert answers and not any(ran for _rows, ran in answers)
    names = {event.name for event in profile.events()}
    assert "minipaged::small_batch_linear" in names and cpu_decode_layers.PROFILER_NAME not in names


def test_a_bad_slot_raises_instead_of_writing_outside_the_cache(tiny_model):
    """The C loop counts the slots it refused to write (outside the pool), and the call raises, as the loop's
    RoPE-and-write does."""
    engine = Engine(tiny_model, block_size=4, num_blocks=64)
    engine.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
    runner_prepare = engine.runner.prepare

    def corrupt(*args, **kwargs):
        model_input = runner_prepare(*args, **kwargs)
        if model_input.meta.slot_mapping.numel() == 1:                  # a decode step
            model_input.meta.slot_mapping.fill_(10 ** 9)
        return model_input
    engine.runner.prepare = corrupt
    with pytest.raises(ValueError, match="cache slots outside"):
        engine.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=3))


def test_the_no_compiled_decode_option_keeps_decode_steps_on_the_loop(tiny_model_untied):
    """--no-compiled-decode (compiled_decode=False) reaches the cpu backend, and its copy in a parallel worker."""
    engine = Engine(tiny_model_untied, compiled_decode=False, block_size=4, num_blocks=32)
    assert engine.backend.name == "cpu" and engine.backend._decode_layers is None
    assert "the layer loop as one call" not in engine.backend.describe()
    copy = pickle.loads(pickle.dumps(engine.backend))               # as a tensor-parallel worker gets it
    assert copy._decode_layers is None and not copy.compiled_decode
