"""The embedded SmolLM2-135M-Instruct: our engine against transformers' greedy generate, token for token."""
from __future__ import annotations

import pytest
import torch

from minipaged import Engine, SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "List three prime numbers and explain in two sentences why each of them is prime.",
    "Explain paged attention to a student who knows what a transformer is but has never thought about how "
    "a server runs many requests at once, and why memory fragmentation matters for throughput.",
    "Translate 'good morning' to Spanish.",
    "Give me a short recipe for pancakes with blueberries, please.",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine("smollm2", num_blocks=256, max_num_batched_tokens=512)


def test_greedy_batch_matches_transformers_one_prompt_at_a_time(engine):
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for q in QUESTIONS]
    assert len({len(p) for p in prompts}) == len(prompts)        # all different lengths
    events = []
    engine.subscribe(events.append)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    assert max(len(e.scheduled) for e in events) == len(prompts)  # they really were decoded together
    hf = engine.loaded.hf_model
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist(), out.text
    assert outs[0].text == "The capital of France is Paris."
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_chat_applies_the_template_and_shares_the_system_prompt(engine):
    system = {"role": "system", "content": "You are a concise assistant who answers in one sentence."}
    convs = [[system, {"role": "user", "content": q}] for q in QUESTIONS[:3]]
    outs = engine.chat(convs, SamplingParams(temperature=0.0, max_tokens=8))
    assert "Paris" in outs[0].text
    assert outs[1].num_cached_tokens > 0 or outs[2].num_cached_tokens > 0   # the shared system prompt was reused


def test_converted_config_names_its_architecture(engine, tmp_path):
    """transformers' own tools (transformers serve) read the model class from config.json's architectures,
    which the GGUF conversion leaves empty; the loader fills it in, in old caches too."""
    import json

    from minipaged.model.loader import name_architecture

    config = json.loads((engine.loaded.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    old = tmp_path / "config.json"
    old.write_text(json.dumps({**config, "architectures": None}))
    name_architecture(old)
    assert json.loads(old.read_text())["architectures"] == ["LlamaForCausalLM"]


def test_structured_outputs_with_the_real_tokenizer(engine):
    """xgrammar compiles offline from SmolLM2's own tokenizer; the answer parses and keeps the schema."""
    import json

    import jsonschema
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    out = engine.chat([{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
                      SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema}))[0]
    answer = json.loads(out.text)
    jsonschema.validate(answer, schema)
    assert answer["city"] == "Paris"
    choice = engine.generate("The capital of France is", SamplingParams(
        temperature=0, max_tokens=4, structured_outputs={"choice": [" Paris", " London"]}))[0]
    assert choice.text == " Paris"
