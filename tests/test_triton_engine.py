"""The whole engine on the triton backend, without a GPU: Triton's interpreter (``TRITON_INTERPRET=1``) runs
the attention kernel and the fused layer ops (norms with the residual add, RoPE with the K/V write, SiLU-and-mul,
greedy argmax: kernels/triton_layer_ops.py) on CPU tensors. A few short requests, through prefix-cache hits, chunked
prefill, both preemption modes and speculative decoding, must give transformers' own greedy tokens, as on the
other backends (the interpreter is slow: the workload is small on purpose).
"""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before any import of triton (as tests/test_triton_kernel.py)

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from minipaged import Engine, SamplingParams  # noqa: E402

MAX_TOKENS = 6


def prompts() -> list[list[int]]:
    """Two sharing a 12-token prefix (three blocks of 4: prefix hits), one that repeats itself (n-grams
    match), one long enough to be chunked under a budget of 16 tokens."""
    rng = random.Random(5)
    shared = [rng.randrange(256) for _ in range(12)]
    phrase = [rng.randrange(256) for _ in range(4)]
    return [shared + [7, 8, 9], shared + [10, 11], phrase * 3, [rng.randrange(256) for _ in range(30)]]


def transformers_greedy(engine: Engine, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens, one at a time (its forward pass, argmax, append: what generate does)."""
    hf, tokens = engine.loaded.hf_model, list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            tokens.append(int(hf(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.parametrize("options", [
    dict(max_num_batched_tokens=16, enable_prefix_caching=True, num_blocks=64),
    dict(num_blocks=10, preemption_mode="recompute", max_num_batched_tokens=64),
    dict(num_blocks=10, preemption_mode="swap", num_cpu_blocks=32, max_num_batched_tokens=64),
    dict(num_blocks=64, speculative_config={"method": "draft_model", "model": "self", "num_draft_layers": 1,
                                            "num_speculative_tokens": 2}),
], ids=["chunked+prefix-hits", "preempt-recompute", "preempt-swap", "self-draft-spec"])
def test_the_engine_on_triton_gives_transformers_greedy_tokens(tiny_model, options):
    engine = Engine(tiny_model, attention_backend="triton", block_size=4, **options)
    assert engine.backend.name == "triton" and engine.kv_cache.device.type == "cpu"
    from minipaged.kernels.triton_layer_ops import TritonLayerOps
    assert isinstance(engine.backend.layer_ops, TritonLayerOps)           # the fused kernels, not torch's ops
    events = []
    engine.subscribe(events.append)
    outs = engine.generate(prompts(), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [transformers_greedy(engine, p) for p in prompts()]
    stats = engine.stats()
    if "max_num_batched_tokens" in options and options["max_num_batched_tokens"] == 16:
        assert stats["prefix_cache_hits"] > 0
        assert any(s.kind == "prefill" and s.end < len(prompts()[3]) for ev in events for s in ev.scheduled)
    if "preemption_mode" in options:
        assert stats[f"preemptions_{options['preemption_mode']}"] > 0
    if "speculative_config" in options:
        assert stats["spec_decode_num_draft_tokens"] > 0          # drafts were verified: several query rows


def test_asking_for_triton_on_a_cpu_without_the_interpreter_says_what_to_do(tiny_model, monkeypatch):
    from minipaged.config import ConfigError
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="runs on CUDA.*TRITON_INTERPRET=1.*attention_backend='torch'"):
        Engine(tiny_model, attention_backend="triton", num_blocks=16)


def test_the_fused_layer_ops_are_off_unless_asked_for(monkeypatch):
    """No GPU has run the fused kernels yet: a user gets torch's layer ops unless --triton-fused-ops (the suite
    makes them its default: conftest.py)."""
    pytest.importorskip("triton")
    from minipaged.kernels.backends import triton_backend
    from minipaged.kernels.backends.triton_backend import FUSED_FLAG, TritonBackend
    from minipaged.kernels.torch_ops import TORCH_LAYER_OPS
    monkeypatch.setattr(triton_backend, "FUSED_BY_DEFAULT", False)       # a user's default
    backend = TritonBackend()
    assert backend.layer_ops is TORCH_LAYER_OPS and FUSED_FLAG in backend.describe()
    assert TritonBackend(fused=True).layer_ops is not TORCH_LAYER_OPS


@pytest.mark.parametrize("fused", [True, False])
def test_the_triton_fused_ops_option_reaches_the_backend(tiny_model, fused):
    """--triton-fused-ops / --no-triton-fused-ops win over the backend's default (the suite's is on)."""
    from minipaged.kernels.torch_ops import TORCH_LAYER_OPS
    engine = Engine(tiny_model, attention_backend="triton", triton_fused_ops=fused, num_blocks=16, block_size=4)
    assert engine.backend.fused is fused and (engine.backend.layer_ops is not TORCH_LAYER_OPS) is fused
