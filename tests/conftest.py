"""Shared fixtures: tiny random Llama checkpoints built on the fly (offline, fast, same loading code)."""
from __future__ import annotations

import os
from typing import Optional

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")          # tests never reach for the network
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from minipaged.kernels.backends import calibration, triton_backend  # noqa: E402
from minipaged.model.testing import build_tiny_llama  # noqa: E402

# The suite's defaults for the backends' switches left unset (cpu_ops=None, triton_fused_ops=None): every compiled
# CPU op, whatever this machine measures faster, and the triton backend's fused layer ops (off for users until a
# GPU run has shown them exact): tests check them all. The choice by measurement is tests/test_cpu_calibration.py's,
# with a fake clock. Servers the tests start get the same with --cpu-ops compiled (tests/serve_util.py).


# ``make test`` runs the suite in two phases (a CI run on two cores took 23 minutes one test at a time):
#   1. the files in TOGETHER, two at a time (pytest-xdist, ``-n 2 --dist loadfile``: a file's fixtures stay in one
#      worker). They compute and compare (engine against transformers, kernels against their references,
#      scheduler cases, hypothesis, the guides' commands in Textual's headless driver) and nothing else: no
#      process, server, browser or terminal is started and no time is measured, so a neighbour on the other core
#      changes how long they take, never what they find.
#   2. every other file, in two lanes (``-n 2 --dist loadgroup``): the serial lane runs servers, browsers, tmux,
#      torchrun, notebooks, bounds on time and the quitting races one test at a time, as before (two of those at
#      once on two cores would make a loaded laptop's timeouts fire); the alongside lane (ALONGSIDE, and tests
#      marked ``alongside``) runs, at the same time on the other core, work of the first phase's kind that is too
#      long for it: SmolLM2's lessons (minutes on one core) and the Textual apps. The serial lane's processes
#      mostly leave the second core idle; to them the alongside lane is a busy neighbour, as on a loaded laptop.
# A new file runs in the serial lane unless it is added to a set here; tests/test_suite_phases.py checks that
# nothing in TOGETHER or ALONGSIDE starts a process or measures a time.
TOGETHER = frozenset("""
    test_anatomy test_api test_architecture_claims test_backend_conformance test_bench test_block_manager
    test_cpu_calibration test_cpu_layer_ops test_decode_layers test_detokenizer
    test_doc_commands_oneshot test_engine_anatomy
    test_event_hub test_fair_share test_import_graph test_input_batch test_labs test_lesson10
    test_lesson_code_refs test_long_prefill test_memory test_metrics test_model_vs_transformers test_output_kind
    test_policies test_quantization test_scheduling test_serve_abort_work test_smollm2 test_spec_decode
    test_suite_phases test_triton_engine test_triton_layer_ops test_tui_state test_workload_presets
""".split())


ALONGSIDE = frozenset("""
    test_compare test_compare_app test_cuda_graphs test_decode_step_race test_doc_commands_lessons
    test_doc_commands_watch test_lessons_pilot test_logits test_threads test_tui_pilot test_tui_snapshots
""".split())


@pytest.hookimpl(tryfirst=True)          # before xdist's own hook reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in TOGETHER:
            item.add_marker(pytest.mark.together)
        elif item.path.stem in ALONGSIDE or item.get_closest_marker("alongside"):
            item.add_marker(pytest.mark.xdist_group("alongside"))
        else:
            item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture(autouse=True, scope="session")
def suite_backend_defaults():
    """Set the backends' defaults for the whole suite, and put the users' defaults back at its end."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "DEFAULT_CPU_OPS", calibration.COMPILED)
        patch.setattr(triton_backend, "FUSED_BY_DEFAULT", True)
        yield


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """GQA (4 query heads over 2 KV heads), tied embeddings."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-tied"), tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_model_untied(tmp_path_factory) -> str:
    """GQA 6:2, untied LM head, a different rope theta, three layers."""
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-untied"), tie_word_embeddings=False, num_heads=6,
                                num_kv_heads=2, hidden_size=96, num_layers=3, rope_theta=50000.0, seed=1))


@pytest.fixture(scope="session")
def tiny_engine_factory(tiny_model):
    """Build an Engine on the tiny model with the given options (blocks of 4 tokens by default)."""
    from minipaged import Engine

    def make(**options):
        options.setdefault("block_size", 4)
        options.setdefault("num_blocks", 256)
        return Engine(tiny_model, **options)
    return make


def random_prompts(rng, n: int, lo: int, hi: int, vocab: int = 256) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def step_until_done(engine, outputs: Optional[dict] = None) -> dict:
    """Step ``engine`` until nothing is left to run; returns the RequestOutputs its steps delivered, by request id
    (``outputs``, when given, is filled and returned)."""
    outputs = {} if outputs is None else outputs
    while engine.has_unfinished_requests():
        outputs.update((d.request_id, d.output) for d in engine.step().outputs if d.output is not None)
    return outputs
