"""Every model family (minipaged/model/families.py) against transformers, on tiny random checkpoints.

One matrix of tiny models covers what distinguishes the families (Llama 3's RoPE scaling, Mistral's sliding
window, Qwen2's q/k/v biases, Qwen3's per-head q/k norm) crossed with what differs between checkpoints
(grouped-query and multi-head attention, tied and untied embeddings, odd head counts, a head_dim that is not
hidden / heads). Each model's norms and biases are random (not transformers' ones and zeros), so a forward
pass that skipped one would give other logits.
"""
from __future__ import annotations

import copy
import json
import os
import random

import pytest
import torch

from minipaged import Engine, SamplingParams
from minipaged.config import ConfigError
from minipaged.model import FAMILIES, UnsupportedModelError, load_model
from minipaged.model.testing import build_tiny_model
from tests.conftest import random_prompts
from tests.test_model_vs_transformers import run_and_capture_logits

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (build_tiny_model arguments, engine options the model needs)
MODELS: dict[str, tuple[dict, dict]] = {
    "llama3-rope-mha-untied": (dict(family="llama", num_heads=4, num_kv_heads=4, tie_word_embeddings=False,
                                    rope_theta=500000.0, rope_parameters=LLAMA3_ROPE), {}),
    "mistral-gqa-untied": (dict(family="mistral", sliding_window=4096, tie_word_embeddings=False), {}),
    # A window the context fits in: full attention is exact, so it runs (with max_model_len <= the window).
    "mistral-window-mha-tied": (dict(family="mistral", num_heads=2, num_kv_heads=2, sliding_window=48),
                                {"max_model_len": 48}),
    "qwen2-gqa-tied": (dict(family="qwen2"), {}),
    "qwen2-odd-heads-untied": (dict(family="qwen2", hidden_size=48, num_heads=3, num_kv_heads=1,
                                    tie_word_embeddings=False), {}),
    "qwen3-gqa-untied": (dict(family="qwen3", head_dim=16, tie_word_embeddings=False), {}),
    # Five heads of 16 over a hidden size of 64: Qwen3 declares head_dim, it is not hidden / heads.
    "qwen3-odd-heads-mha-tied": (dict(family="qwen3", num_heads=5, num_kv_heads=5, head_dim=16), {}),
}
# The runs with two processes: tp=2 on one row per family (their heads divide by two), pp=2 on Qwen3's q/k norm.
TWO_RANKS = [("llama3-rope-mha-untied", "tp"), ("mistral-gqa-untied", "tp"), ("qwen2-gqa-tied", "tp"),
             ("qwen3-gqa-untied", "tp"), ("qwen3-odd-heads-mha-tied", "pp")]


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """``family_model(name)`` -> (folder of the tiny checkpoint, engine options it needs); built once."""
    built: dict[str, str] = {}

    def get(name: str) -> tuple[str, dict]:
        arguments, options = MODELS[name]
        if name not in built:
            arguments = dict(arguments)
            family = arguments.pop("family")
            built[name] = str(build_tiny_model(tmp_path_factory.mktemp(name), family, **arguments))
        return built[name], options
    return get


def transformers_greedy(hf_model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy ``generate`` for ``max_tokens`` tokens, end-of-sequence included as a token like any
    other (what ``ignore_eos`` does; ``min_new_tokens`` would instead forbid it and pick the runner-up)."""
    config = copy.deepcopy(hf_model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)   # [] never stops
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def test_the_matrix_covers_every_family():
    assert {args["family"] for args, _ in MODELS.values()} == set(FAMILIES)
    assert {MODELS[name][0]["family"] for name, split in TWO_RANKS if split == "tp"} == set(FAMILIES)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_transformers_for_a_batch_decoded_together(family_model, name, backend):
    path, options = family_model(name)
    engine = Engine(path, block_size=4, num_blocks=64, attention_backend=backend, **options)
    assert engine.info.attention_backend == backend
    prompts = random_prompts(random.Random(3), 4, 3, 29)
    assert len({len(p) for p in prompts}) > 1                               # different lengths
    outs, captured, events = run_and_capture_logits(engine, prompts, max_tokens=5)
    everyone = {out.request_id for out in outs}
    assert any({s.request_id for s in ev.scheduled if s.kind == "decode"} == everyone for ev in events)
    hf = engine.loaded.hf_model
    for out in outs:
        with torch.no_grad():
            ref = hf(torch.tensor([out.prompt_token_ids + out.token_ids])).logits[0].float()
        n_prompt = len(out.prompt_token_ids)
        theirs = ref[n_prompt - 1:n_prompt - 1 + len(out.token_ids)]
        torch.testing.assert_close(torch.stack(captured[out.request_id]), theirs, atol=2e-5, rtol=1e-4)
        assert out.token_ids == theirs.argmax(-1).tolist()


def shared_prefix_prompts(seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(12)]
    return [shared + p for p in random_prompts(rng, 5, 2, 14)]


# Few blocks (preemption), a budget of 8 tokens a step (chunked prefill), prompts sharing 12 tokens (prefix hits).
TIGHT = {"block_size": 4, "num_blocks": 14, "max_num_batched_tokens": 8}


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_generate_under_chunks_prefix_hits_and_preemption(family_model, name):
    path, options = family_model(name)
    engine = Engine(path, **TIGHT, **options)
    events = []
    engine.subscribe(events.append)
    prompts = shared_prefix_prompts()
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stats = engine.stats()
    assert stats["preemptions_recompute"] > 0 and stats["prefix_cache_hits"] > 0
    assert any(s.kind == "prefill" and s.end < s.prompt_len for ev in events for s in ev.scheduled)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(engine.loaded.hf_model, prompt, 10)
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("name, split", TWO_RANKS, ids=[f"{split}2-{name}" for name, split in TWO_RANKS])
def test_two_ranks_give_transformers_tokens_under_chunks_prefix_hits_and_preemption(family_model, name, split):
    """Two ranks over gloo, one thread each. tp: the biases cut with their heads, the q/k norms whole on each
    rank; pp: each rank its own layers, with their norms."""
    path, options = family_model(name)
    prompts = shared_prefix_prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    layout = {"tensor_parallel_size": 2} if split == "tp" else {"pipeline_parallel_size": 2}
    with Engine(path, **{**TIGHT, "num_blocks": 10}, **options, **layout, num_threads=1,
                distributed_timeout=60) as engine:
        outs = engine.generate(prompts, params)
        stats = engine.stats()
        assert engine.info.parallel.startswith(f"{split}=2")
    assert stats["preemptions_recompute"] > 0 and stats["prefix_cache_hits"] > 0
    hf = load_model(path).hf_model
    assert [o.token_ids for o in outs] == [transformers_greedy(hf, p, params.max_tokens) for p in prompts]


@pytest.mark.parametrize("draft", ["same-checkpoint", "one-layer-qwen3"])
def test_speculative_decoding_with_a_draft_checkpoint_of_the_same_vocabulary(family_model, draft, tmp_path):
    """A Qwen3 target drafted by a separate checkpoint: itself (every guess must be accepted, so the draft's
    forward pass is the target's to the last bit that argmax sees) or another, one-layer Qwen3 with the same
    tokenizer (mostly rejected guesses, and the tokens still transformers')."""
    path, _ = family_model("qwen3-gqa-untied")
    draft_path = path if draft == "same-checkpoint" else str(
        build_tiny_model(tmp_path / "draft", "qwen3", num_layers=1, head_dim=16, seed=3))
    engine = Engine(path, block_size=4, num_blocks=64, speculative_config={
        "method": "draft_model", "model": draft_path, "num_speculative_tokens": 3})
    prompts = random_prompts(random.Random(9), 3, 4, 20)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    if draft == "same-checkpoint":
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    else:
        assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(engine.loaded.hf_model, prompt, 10)


def test_llama3_rope_scaling_changes_the_frequencies_the_engine_uses(family_model):
    """The RoPE tables come from transformers' rotary module, so Llama 3's scaling (here on a 32-token original
    context) is in them; the logits test above shows they are the right ones."""
    path, _ = family_model("llama3-rope-mha-untied")
    model = Engine(path, block_size=4, num_blocks=8).model
    head_dim = model.head_dim
    plain = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    assert model.inv_freq[0] == plain[0]                                  # the highest frequency is left alone
    torch.testing.assert_close(model.inv_freq[-3:].cpu(), plain[-3:] / 8.0)   # the lowest are divided by factor


# ------------------------------------------------------------------------------------------ refusals

def test_an_unsupported_family_is_refused_in_one_sentence_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 1}))
    with pytest.raises(UnsupportedModelError) as info:
        Engine(str(tmp_path))
    message = str(info.value)
    assert "'gpt2'" in message and message.endswith(".") and ". " not in message           # one sentence
    for family in ("llama", "mistral", "qwen2", "qwen3"):
        assert f"{family} (" in message


@pytest.mark.parametrize("family, fields", [("mistral", {"sliding_window": 48}),
                                            ("qwen2", {"use_sliding_window": True, "sliding_window": 48})])
def test_a_sliding_window_shorter_than_the_context_is_refused_with_the_fix(tmp_path, family, fields):
    path = build_tiny_model(tmp_path / family, family, num_layers=1, max_position_embeddings=256, **fields)
    with pytest.raises(ConfigError, match=r"sliding window of 48 tokens.*max_model_len is 256.*--max-model-len 48"):
        Engine(str(path), block_size=4, num_blocks=8)
    with pytest.raises(ConfigError, match="max_model_len is 49"):
        Engine(str(path), block_size=4, num_blocks=8, max_model_len=49)
    Engine(str(path), block_size=4, num_blocks=8, max_model_len=48)          # the window covers every sequence


def test_a_qwen_window_that_is_switched_off_is_not_a_window(tmp_path):
    """Qwen2.5's configs carry ``sliding_window`` with ``use_sliding_window: false``: full attention, runs."""
    path = build_tiny_model(tmp_path / "qwen2", "qwen2", num_layers=1, max_position_embeddings=256)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "use_sliding_window": False, "sliding_window": 48}))
    assert Engine(str(path), block_size=4, num_blocks=8).info.max_model_len == 256


@pytest.mark.parametrize("family, change, words", [
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_type='dynamic'"),
])
def test_family_variants_the_forward_pass_does_not_compute_are_refused(tmp_path, family, change, words):
    path = build_tiny_model(tmp_path / family, family, num_layers=1, head_dim=16) if family == "qwen3" else \
        build_tiny_model(tmp_path / family, family, num_layers=1)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UnsupportedModelError, match=words):
        Engine(str(path), block_size=4, num_blocks=8)


TRITON_SCRIPT = """
import json, random, sys
import torch
from minipaged import Engine
from tests.conftest import random_prompts
from tests.test_model_vs_transformers import run_and_capture_logits
worst = {}
for path in sys.argv[1:]:
    prompts = random_prompts(random.Random(2), 2, 3, 9)
    logits = [run_and_capture_logits(Engine(path, block_size=4, num_blocks=32, attention_backend=backend,
                                            triton_fused_ops=True), prompts,
                                     max_tokens=2)[1] for backend in ("triton", "torch")]
    worst[path] = max(float((torch.stack(logits[0][r]) - torch.stack(logits[1][r])).abs().max()) for r in logits[1])
print(json.dumps(worst))
"""


def test_triton_backend_in_the_interpreter_computes_the_families_like_torch(family_model):
    """The Triton attention kernel, run on the CPU by Triton's interpreter (slow: tiny shapes, a fresh process
    so that TRITON_INTERPRET is set before Triton loads), with the q/k norm and the biases in front of it."""
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("triton")
    paths = [family_model(name)[0] for name in ("qwen2-odd-heads-untied", "qwen3-odd-heads-mha-tied")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, *paths], capture_output=True, text=True, env=env,
                          timeout=300, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(worst) == set(paths) and max(worst.values()) <= 2e-5, worst


def test_the_command_line_runs_a_family_folder_and_refuses_a_window_with_the_fix(family_model, tmp_path, capsys):
    """``--model`` takes a local folder of any family, as it takes a Llama one; refusals are one line, exit 2."""
    from minipaged.cli import main
    path, _ = family_model("qwen3-odd-heads-mha-tied")
    assert main(["generate", "--model", path, "--max-tokens", "4", "--no-chat", "--block-size", "4", "hello"]) == 0
    assert capsys.readouterr().out.strip()
    window = build_tiny_model(tmp_path / "mistral", "mistral", num_layers=1, sliding_window=32,
                              max_position_embeddings=64)
    assert main(["generate", "--model", str(window), "--max-tokens", "2", "hi"]) == 2
    assert "--max-model-len 32" in capsys.readouterr().err
    assert main(["generate", "--model", str(window), "--max-tokens", "2", "--max-model-len", "32", "hi"]) == 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_a_gguf_file_of_each_family_runs_like_its_folder(tmp_path, monkeypatch, family):
    """``--model file.gguf``: transformers reads the GGUF, minipaged converts it once into its cache, and the
    tokens are the folder's (float32 GGUF: the same weights). llama.cpp writes Mistral as llama, so it comes back
    a llama; transformers reads no head_dim from a Qwen3 GGUF (it takes Qwen3's 128), so this one has 128."""
    from minipaged.model.loader import resolve_model_path
    from minipaged.model.testing import write_tiny_gguf
    monkeypatch.setenv("MINIPAGED_CACHE", str(tmp_path / "cache"))
    shape = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 128} if family == "qwen3" else {}
    folder = build_tiny_model(tmp_path / "hf", family, num_layers=1, tie_word_embeddings=family != "qwen2", **shape)
    gguf = write_tiny_gguf(folder, tmp_path / f"tiny-{family}.gguf")
    prompts = random_prompts(random.Random(4), 2, 3, 12)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engines = [Engine(str(path), block_size=4, num_blocks=32, attention_backend="torch") for path in (gguf, folder)]
    tokens = [[o.token_ids for o in engine.generate(prompts, params)] for engine in engines]
    assert tokens[0] == tokens[1]
    assert engines[0].model.family.model_type == ("llama" if family == "mistral" else family)
    assert engines[0].tokenizer.encode("hi \u00e9") == engines[1].tokenizer.encode("hi \u00e9")
    assert resolve_model_path(str(gguf))[1] is False                         # converted once, then cached
