"""The whole engine on CUDA (Triton kernel path) against the CPU path. Skipped without a GPU."""
from __future__ import annotations

import pytest
import torch

from minipaged import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Hi",
           "Explain in one paragraph why the sky is blue, for a ten-year-old."]


@pytest.mark.slow
def test_smollm2_greedy_tokens_on_cuda_match_cpu():
    params = SamplingParams(temperature=0.0, max_tokens=24)
    cpu = Engine("smollm2", device="cpu", num_blocks=256)
    cuda = Engine("smollm2", device="cuda", dtype="float32", num_blocks=256)
    assert cuda.backend.name == "triton"
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    assert [o.token_ids for o in cuda.chat(chats, params)] == [o.token_ids for o in cpu.chat(chats, params)]


def test_tiny_model_cuda_with_chunking_and_preemption_matches_cpu(tiny_model):
    prompts = [[(7 * i + j) % 250 for j in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = Engine(tiny_model, device="cpu", block_size=16, num_blocks=64).generate(prompts, params)
    gpu = Engine(tiny_model, device="cuda", dtype="float32", block_size=16, num_blocks=12,
                 max_num_batched_tokens=32, preemption_mode="swap", num_cpu_blocks=32)
    outs = gpu.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert gpu.stats()["preemptions_swap"] + gpu.stats()["preemptions_recompute"] > 0
