"""SmolLM2 (9 heads, 3 KV heads, 30 layers) split three ways and in two stages: the same greedy tokens."""
from __future__ import annotations

import pytest
import torch

from minipaged import Engine, SamplingParams
from tests.test_model_vs_transformers import run_and_capture_logits

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
OPTIONS = {"num_blocks": 64, "num_threads": 1, "max_num_batched_tokens": 256, "distributed_timeout": 300}


@pytest.fixture(scope="module")
def single():
    engine = Engine("smollm2", **OPTIONS)
    prompts = [engine.inputs.chat_prompt([{"role": "user", "content": q}]) for q in QUESTIONS]
    outs, logits, _ = run_and_capture_logits(engine, prompts, 12)
    return prompts, [o.token_ids for o in outs], logits


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}], ids=["tp3", "pp2"])
def test_smollm2_split_gives_the_same_tokens(single, layout):
    prompts, tokens, logits = single
    with Engine("smollm2", **OPTIONS, **layout) as engine:
        if "tensor_parallel_size" in layout:
            assert engine.info.parallel == "tp=3: 3 heads, 1 KV head per rank"
        else:
            assert engine.info.parallel == "pp=2: layers 0-14 | 15-29"
        outs, parallel_logits, _ = run_and_capture_logits(engine, prompts, 12)
    assert [o.token_ids for o in outs] == tokens
    for rid, rows in logits.items():
        torch.testing.assert_close(torch.stack(parallel_logits[rid]), torch.stack(rows), atol=1e-4, rtol=0)
