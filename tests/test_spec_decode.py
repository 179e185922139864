"""Speculative decoding: configuration, exactness (greedy and sampled), scheduling and events.

The rule for every engine feature holds here too: speculation must never change greedy outputs. Greedy
outputs are compared with speculation off (itself checked against transformers elsewhere) and, once,
with transformers' own greedy ``generate``. Sampled outputs are checked for the right *distribution*.
"""
from __future__ import annotations

import logging
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged import Engine, SamplingParams
from minipaged.cli import main as cli_main
from minipaged.config import ConfigError
from minipaged.event_view import EngineView
from minipaged.events import StepEvent
from minipaged.options import add_engine_arguments, engine_options
from minipaged.spec_decode import rejection_sampler
from minipaged.spec_decode.config import SpeculativeConfig
from minipaged.spec_decode.ngram import NgramProposer, find_ngram_continuation
from minipaged.spec_decode.proposer import Draft
from minipaged.spec_decode import speculator as speculator_module
from minipaged.spec_decode.rejection_sampler import greedy_verdict, verify

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SELF_DRAFT = {"method": "draft_model", "model": "self", "num_draft_layers": 1, "num_speculative_tokens": 3}
INT8 = {"method": "int8_self_draft", "num_speculative_tokens": 3}


def repetitive_prompts(seed: int = 0, n: int = 8) -> list[list[int]]:
    """Prompts that quote themselves (so n-grams match) beside plain random ones, sharing a prefix."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(12)]
    prompts = []
    for i in range(n):
        phrase = [rng.randrange(256) for _ in range(rng.randint(3, 7))]
        body = phrase * rng.randint(2, 4) if i % 2 == 0 else [rng.randrange(256) for _ in range(rng.randint(2, 30))]
        prompts.append(system + body if i % 3 else body)
    return prompts


def greedy_tokens(engine: Engine, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


# ----------------------------------------------------------------------------------- configuration

@pytest.mark.parametrize("config, message", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "unknown speculative method 'medusa'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must not exceed prompt_lookup_max \(2\)"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs model"),
    ({"method": "draft_model", "model": "self", "num_draft_layers": 0, "num_speculative_tokens": 2},
     "num_draft_layers must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown speculative_config key\(s\) \['k'\]"),
    ({"method": "int8_self_draft", "num_speculative_tokens": 2, "num_draft_layers": 3}, "num_draft_layers does not"),
    ({"method": "ngram", "num_speculative_tokens": 2, "auto_k": "yes"}, "auto_k must be true or false"),
    ('{"method": "ngram", ', "not valid JSON"),
])
def test_bad_speculative_configs_fail_before_anything_loads(config, message):
    with pytest.raises(ConfigError, match=message):
        Engine("/nonexistent/model/folder", speculative_config=config)   # it would fail to load, later


def test_vllm_defaults_for_the_lookup_bounds():
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)


def test_a_draft_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from minipaged.model.testing import build_byte_tokenizer
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    build_byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens and the target 259"):
        Engine(tiny_model, speculative_config={"method": "draft_model", "model": str(tmp_path),
                                               "num_speculative_tokens": 2})


def test_a_self_draft_cannot_have_more_layers_than_the_target(tiny_model):
    with pytest.raises(ConfigError, match="the target has 2 layers; use 1 to 1"):
        Engine(tiny_model, speculative_config={**SELF_DRAFT, "num_draft_layers": 3})


def test_a_self_draft_of_all_layers_is_always_right_and_says_it_never_pays(tiny_engine_factory, caplog):
    whole = {"method": "draft_model", "model": "self", "num_speculative_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="minipaged"):   # other tests quiet the "minipaged" logger
        engine = tiny_engine_factory(speculative_config=whole)
    assert "every guess will be accepted" in caplog.text
    assert engine.info.speculative == "self-draft all layers k=3"
    engine.generate(repetitive_prompts(n=3), GREEDY)
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def parse_flags(words: list[str]) -> dict:
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return engine_options(parser.parse_args(words))


def test_the_int8_self_draft_is_the_target_in_int8_and_agrees_with_it(tiny_engine_factory):
    """Method int8_self_draft: the draft model's matrices and LM head are int8 (the target's stay fp32, and it
    decides every token), it shares the target's embedding and its KV cache (no KV of its own, no prompt to
    catch up on: every drafting pass is one row a request), and it nearly always guesses the target's greedy
    token; a target quantized already is refused (its draft would be itself)."""
    from minipaged.kernels.int8 import Int8Weight
    engine = tiny_engine_factory(speculative_config=INT8)
    assert engine.info.speculative == "int8 self-draft k=3"
    draft, target = engine.speculator.proposer.model, engine.model
    assert all(isinstance(getattr(w, name), Int8Weight) for w in draft.layers for name in ("qkv", "o", "gate_up",
                                                                                          "down"))
    assert isinstance(draft.lm_head, Int8Weight) and not isinstance(target.lm_head, Int8Weight)
    assert not isinstance(target.layers[0].qkv, Int8Weight) and draft.embed is target.embed
    proposer = engine.speculator.proposer
    assert proposer.kv_cache is engine.runner.kv_cache
    assert engine.info.kv_bytes_per_token == target.kv_bytes_per_token()
    rows, prepare = [], proposer.runner.prepare
    proposer.runner.prepare = lambda chunks, *a, **k: rows.append(max(c.num_new_tokens for c in chunks)) or prepare(
        chunks, *a, **k)
    prompts = repetitive_prompts(seed=4, n=4)
    assert greedy_tokens(engine, prompts) == greedy_tokens(tiny_engine_factory(), prompts)
    assert rows and set(rows) == {1}
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.8 * stats["spec_decode_num_draft_tokens"] > 0
    with pytest.raises(ConfigError, match="already int8"):
        tiny_engine_factory(quantization="int8", speculative_config=INT8)


def test_a_draft_model_does_not_feed_again_the_guesses_it_fed_itself(tiny_engine_factory, tiny_model):
    """The draft's own guesses d_0 .. d_{k-2} left their KV in its cache: once accepted, the next catch-up
    starts after them, so after the prompt every drafting pass is one or two rows (the target as its own draft:
    every guess accepted, which a wrong reused KV would break)."""
    engine = tiny_engine_factory(speculative_config={"method": "draft_model", "model": tiny_model,
                                                     "num_speculative_tokens": 3})
    proposer = engine.speculator.proposer
    rows, prepare = [], proposer.runner.prepare

    def noting(chunks, *args, **kwargs):
        rows.append(max(c.num_new_tokens for c in chunks))
        return prepare(chunks, *args, **kwargs)
    proposer.runner.prepare = noting
    prompt = repetitive_prompts(seed=6, n=1)[0]
    assert greedy_tokens(engine, [prompt]) == greedy_tokens(tiny_engine_factory(), [prompt])
    stats = engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert rows[0] == len(prompt) + 1 and max(rows[1:]) == 2        # (the prompt and the first token)


def test_the_guides_flags_and_vllms_json_both_configure_speculation():
    assert parse_flags(["--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    assert parse_flags(["--speculative-model", "self", "--num-draft-layers", "8", "--num-speculative-tokens", "5"]) \
        == {"speculative_config": {"model": "self", "num_draft_layers": 8, "num_speculative_tokens": 5,
                                   "method": "draft_model"}}
    assert parse_flags(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                        "--prompt-lookup-max", "3"]) == {
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}}
    assert parse_flags(["--speculative-method", "int8_self_draft", "--num-speculative-tokens", "3",
                        "--speculative-auto-k"]) == {
        "speculative_config": {"method": "int8_self_draft", "num_speculative_tokens": 3, "auto_k": True}}


def test_a_bad_flag_value_is_a_clear_error_on_the_command_line(capsys):
    code = cli_main(["generate", "hi", "--model", "/nonexistent", "--speculative-method", "ngram",
                     "--num-speculative-tokens", "0"])
    assert code == 2
    assert "num_speculative_tokens must be an integer >= 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- n-gram lookup

def test_ngram_lookup_prefers_the_longest_suffix_then_the_earliest_occurrence():
    assert find_ngram_continuation([1, 2, 3, 4, 5, 1, 2, 3], 2, 4, 3) == [4, 5, 1]
    # "9 1 2" (3 tokens) beats the later, shorter match of "1 2"
    assert find_ngram_continuation([9, 1, 2, 7, 5, 1, 2, 8, 9, 1, 2], 2, 3, 2) == [7, 5]
    assert find_ngram_continuation([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [7, 1]   # earliest of equals
    assert find_ngram_continuation([1, 2, 3, 4], 2, 4, 3) == []                      # no match: no draft
    assert find_ngram_continuation([1, 2, 9, 1, 2], 2, 4, 5) == [9, 1, 2]            # the text ran out
    assert find_ngram_continuation([1, 2, 9, 1, 2], 3, 4, 5) == []                   # shorter than min



def _scan_every_position(tokens, min_n, max_n, k):
    """The rule read literally: every start, every n (what the lookup must agree with)."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for start in range(0, total - n):
            if tokens[start:start + n] == tokens[total - n:]:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=60), ns=st.sampled_from([(1, 1), (2, 4), (2, 2), (3, 5)]),
       k=st.integers(1, 6))
def test_the_ngram_lookup_answers_what_reading_every_position_answers(tokens, ns, k):
    """The lookup jumps between occurrences of the suffix's first token: at every length of text it must find what
    a comparison at every position finds (a small alphabet: many partial matches)."""
    for end in range(len(tokens) + 1):
        assert find_ngram_continuation(tokens[:end], *ns, k) == _scan_every_position(tokens[:end], *ns, k)


# ----------------------------------------------------------------------------------- greedy exactness

@pytest.fixture(scope="module")
def reference(tiny_engine_factory):
    return greedy_tokens(tiny_engine_factory(enable_prefix_caching=False, num_blocks=512), repetitive_prompts())


FEATURES = {
    "defaults": {},
    "budget-5": dict(max_num_batched_tokens=5),          # drafts trimmed to fit, prompts chunked
    "budget-17": dict(max_num_batched_tokens=17),
    "chunked-off": dict(enable_chunked_prefill=False),
    "preempt-recompute": dict(num_blocks=22, preemption_mode="recompute"),
    "preempt-swap": dict(num_blocks=22, preemption_mode="swap", num_cpu_blocks=64),
    "prefix-cache-off": dict(enable_prefix_caching=False),
    "max-num-seqs-2": dict(max_num_seqs=2),
}
DRAFTERS = {
    "ngram": NGRAM,
    "ngram-auto-k": {**NGRAM, "auto_k": True},
    "int8-self-draft": INT8,
    "self-draft": SELF_DRAFT,
    "other-model": None,              # filled in with the untied tiny model: another architecture, same vocab
    "target-itself": None,            # the target as its own draft: every guess is right
}


def pin_step_costs(engine: Engine, seconds: dict[int, float]) -> None:
    """The automatic k's step costs pinned (seconds by rows): learnt from the tiny model's timings, its choices
    would change from run to run."""
    from minipaged.spec_decode.auto_k import StepCost
    engine.speculator.auto.cost = StepCost(dict(seconds))
    engine.speculator.auto.cost.observe = lambda rows, seconds: None


def drafter(name: str, tiny_model: str, tiny_model_untied: str) -> dict:
    if name == "other-model":
        return {"method": "draft_model", "model": tiny_model_untied, "num_speculative_tokens": 4}
    if name == "target-itself":
        return {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 4}
    return DRAFTERS[name]


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_outputs_are_unchanged_by_speculation(name, feature, reference, tiny_engine_factory, tiny_model,
                                                     tiny_model_untied):
    engine = tiny_engine_factory(speculative_config=drafter(name, tiny_model, tiny_model_untied),
                                 **FEATURES[feature])
    if engine.speculator.auto is not None:
        pin_step_costs(engine, {1: 0.014, 64: 0.016})           # rows nearly free: drafts pay even at batch 8
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    assert greedy_tokens(engine, repetitive_prompts()) == reference
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    if name == "target-itself":
        assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    if feature.startswith("preempt"):
        assert stats["preemptions_recompute"] + stats["preemptions_swap"] > 0
    for event in events:
        assert event.budget_used <= event.budget_limit
    assert stats["blocks_free"] == stats["blocks_total"] and stats["cpu_blocks_free"] == stats["cpu_blocks_total"]
    engine.kv.check_invariants()


def test_speculation_matches_transformers_generate_and_takes_fewer_steps(tiny_model_untied):
    prompts = repetitive_prompts(seed=3, n=4)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = Engine(tiny_model_untied, block_size=8, num_blocks=64)
    spec = Engine(tiny_model_untied, block_size=8, num_blocks=64,
                  speculative_config={"method": "draft_model", "model": tiny_model_untied, "num_speculative_tokens": 3})
    ours = greedy_tokens(spec, prompts, params)
    hf = plain.loaded.hf_model
    for prompt, tokens in zip(prompts, ours):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                          do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == ref
    greedy_tokens(plain, prompts, params)
    # four tokens per target forward when every guess is right: far fewer steps than one token each
    assert spec.stats()["steps"] * 2 < plain.stats()["steps"]


def test_parallel_samples_and_stop_strings_with_speculation(tiny_engine_factory):
    prompts = repetitive_prompts(seed=5, n=3)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    plain = tiny_engine_factory().generate(prompts, params)
    spec = tiny_engine_factory(speculative_config=SELF_DRAFT).generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]
    # a stop string in the middle of an accepted run: the tokens after it never happened
    text = plain[0].outputs[0].text
    stop = text[5:7]
    stopped_plain = tiny_engine_factory().generate(prompts[:1], SamplingParams(temperature=0, max_tokens=24,
                                                                               stop=[stop], ignore_eos=True))[0]
    target_draft = {"method": "draft_model", "model": "self", "num_draft_layers": 1, "num_speculative_tokens": 6}
    stopped_spec = tiny_engine_factory(speculative_config=target_draft).generate(
        prompts[:1], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert stopped_spec.outputs[0].token_ids == stopped_plain.outputs[0].token_ids
    assert stopped_spec.outputs[0].text == stopped_plain.outputs[0].text


def test_drafts_never_pass_max_tokens_or_max_model_len(tiny_engine_factory):
    engine = tiny_engine_factory(max_model_len=40, speculative_config={**NGRAM, "num_speculative_tokens": 8})
    prompt = [7, 8, 9] * 11                               # 33 tokens that the lookup keeps matching
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(prompt) + len(out.token_ids) == 40
    assert all(s.end <= 40 for e in events for s in e.scheduled)
    out = engine.generate([prompt[:12]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert len(out.token_ids) == 5


# ----------------------------------------------------------------------------------- events

def test_events_carry_drafts_and_verdicts_and_replay_the_same(tiny_engine_factory):
    engine = tiny_engine_factory(speculative_config=SELF_DRAFT, num_blocks=40)
    view = EngineView(engine.info)
    assert engine.info.speculative == "self-draft 1 layers k=3" and engine.info.num_speculative_tokens == 3
    for prompt in repetitive_prompts(seed=2, n=6):
        engine.add_request(prompt, GREEDY)
    events = []
    while engine.has_unfinished_requests():
        event = engine.step().event
        events.append(event)
        view.apply(event)
        replayed = StepEvent.from_dict(__import__("json").loads(event.to_json()))
        assert replayed == event
        running = {r.request_id: r for r in engine.scheduler.running}
        for s in event.scheduled:
            assert s.num_accepted <= len(s.draft_token_ids)
            if s.draft_token_ids:
                assert s.kind == "decode"
                new = event.new_token_ids.get(s.request_id, [])
                assert new[:s.num_accepted] == list(s.draft_token_ids[:s.num_accepted])
            if s.request_id in running:        # the view, from events alone, knows how much KV is real
                assert view.requests[s.request_id].num_computed == running[s.request_id].num_computed_tokens
        for block in engine.kv.pool.blocks:
            assert len(view.block_owners[block.block_id]) == block.ref_cnt
            assert view.block_cached[block.block_id] == (block.block_hash is not None)
    drafted = sum(len(s.draft_token_ids) for e in events for s in e.scheduled)
    accepted = sum(s.num_accepted for e in events for s in e.scheduled)
    stats = engine.stats()
    assert (drafted, accepted) == (stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"])
    per_position = [stats.get(f"spec_decode_num_accepted_tokens_pos_{i}", 0) for i in range(3)]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)


def test_drafts_are_never_shared_through_the_prefix_cache(tiny_engine_factory):
    """A rejected draft's slot must not end up in a cached block: run with a drafter that is always wrong,
    then a second request with the first one's prompt + output must get exactly the same tokens."""
    engine = tiny_engine_factory(speculative_config={**NGRAM, "prompt_lookup_min": 1, "prompt_lookup_max": 1})
    prompt = [5, 6, 5, 6, 5, 6, 5]
    first = engine.generate([prompt], GREEDY)[0]
    assert engine.stats()["spec_decode_num_draft_tokens"] > engine.stats()["spec_decode_num_accepted_tokens"]
    again = tiny_engine_factory(enable_prefix_caching=False).generate([prompt + first.token_ids[:12]], GREEDY)[0]
    cached = engine.generate([prompt + first.token_ids[:12]], GREEDY)[0]
    assert cached.num_cached_tokens > 0 and cached.token_ids == again.token_ids


# ----------------------------------------------------------------------------------- the rejection sampler

def total_variation(counts: Counter, p: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(i, 0) / n - float(p[i])) for i in range(len(p)))


P = torch.tensor([[0.05, 0.40, 0.05, 0.30, 0.10, 0.10], [0.30, 0.05, 0.05, 0.10, 0.20, 0.30]])
Q = torch.tensor([[0.50, 0.05, 0.30, 0.05, 0.05, 0.05], [0.05, 0.50, 0.20, 0.05, 0.10, 0.10]])
PARAMS = SamplingParams(temperature=1.0)


def sample_outputs(num: int, seed: int, with_q: bool) -> tuple[Counter, Counter]:
    """Run the sampler ``num`` times on synthetic p and q: the first and second output token's counts."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.cat([P.log(), P[1:].log()])            # rows for d_0, d_1 and the bonus
    first, second = Counter(), Counter()
    for _ in range(num):
        if with_q:
            d = [int(torch.multinomial(Q[i], 1, generator=gen)) for i in range(2)]
            draft = Draft(d, Q.clone())
        else:
            draft = Draft([1, 0])                                  # a fixed guess (q = 1 for it: n-gram)
        out = verify(target_logits, draft, PARAMS, gen)
        first[out.token_ids[0]] += 1
        if len(out.token_ids) > 1:
            second[out.token_ids[1]] += 1
    return first, second


@pytest.mark.parametrize("with_q", [True, False], ids=["draft-model", "ngram"])
def test_rejection_sampling_outputs_the_targets_distribution(with_q):
    first, second = sample_outputs(6000, seed=1, with_q=with_q)
    assert total_variation(first, P[0]) < 0.03
    assert total_variation(second, P[1]) < 0.04


def test_sampling_the_recovered_token_from_p_instead_of_p_minus_q_is_caught(monkeypatch):
    monkeypatch.setattr(rejection_sampler, "recovered_distribution", lambda p, q: p)
    first, _ = sample_outputs(6000, seed=1, with_q=True)
    assert total_variation(first, P[0]) > 0.1


def test_verification_with_top_k_and_temperature_applies_them_to_p_first():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.5, top_k=2, seed=0)
    gen = torch.Generator().manual_seed(0)
    outs = Counter(verify(logits, Draft([3]), params, gen).token_ids[0] for _ in range(3000))
    assert set(outs) <= {0, 1}                                    # token 3 is outside top-k: always rejected
    p0 = torch.softmax(torch.tensor([4.0, 3.0]) / 0.5, -1)
    assert abs(outs[0] / 3000 - float(p0[0])) < 0.03


def test_greedy_verification_keeps_the_agreeing_prefix_and_the_targets_token():
    logits = torch.full((4, 8), -5.0)
    for row, best in enumerate([3, 1, 4, 6]):
        logits[row, best] = 5.0
    gen = torch.Generator().manual_seed(0)
    greedy = SamplingParams(temperature=0)
    assert verify(logits, Draft([3, 1, 4]), greedy, gen).token_ids == [3, 1, 4, 6]      # all + bonus
    assert verify(logits, Draft([3, 2, 4]), greedy, gen).token_ids == [3, 1]            # recovered at 1
    assert verify(logits, Draft([0, 1, 4]), greedy, gen).num_accepted == 0


def test_a_steps_greedy_verifications_take_one_argmax_for_all_rows(tiny_engine_factory, monkeypatch):
    """The engine verifies greedy drafts from one argmax over the step's rows (the backend's), not one torch
    argmax a request; a verifier put in the rejection sampler's place (lab 4) still gets every request."""
    engine = tiny_engine_factory(speculative_config=NGRAM)
    calls = []
    monkeypatch.setattr(rejection_sampler, "greedy_verdict", lambda *a: calls.append(a) or greedy_verdict(*a))
    monkeypatch.setattr(speculator_module, "greedy_verdict", rejection_sampler.greedy_verdict)
    argmaxes, argmax = [], engine.sampler.argmax
    engine.sampler.argmax = lambda logits: argmaxes.append(len(logits)) or argmax(logits)
    prompts = repetitive_prompts(seed=8, n=4)
    assert greedy_tokens(engine, prompts) == greedy_tokens(tiny_engine_factory(), prompts)
    verified = engine.stats()["spec_decode_num_drafts"]
    assert verified > 0 and len(calls) == verified and max(argmaxes) > len(prompts)
    engine.speculator.verify_drafts = lambda logits, draft, params, gen: own.append(draft) or greedy_verdict(
        logits.argmax(-1).tolist(), draft.token_ids)                    # (the module's own function: not counted)
    own, calls[:] = [], []
    assert greedy_tokens(engine, prompts) == greedy_tokens(tiny_engine_factory(), prompts)
    assert own and not calls


def test_first_verified_token_has_the_same_distribution_with_and_without_speculation(tiny_engine_factory,
                                                                                      monkeypatch):
    """End to end at temperature 1.3 with top-k 3, over 1500 seeds: the first two generated tokens (the
    second is the first one a verification decides) with a self-draft vs without speculation. The same
    bound catches a rejection sampler that samples the recovered token from p instead of max(p - q, 0)."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    num = 1500

    engines = []

    def first_two(**options) -> Counter:
        engine = tiny_engine_factory(num_blocks=2048, **options)
        engines.append(engine)
        params = [SamplingParams(temperature=1.3, top_k=3, max_tokens=3, seed=s, ignore_eos=True) for s in range(num)]
        return Counter(tuple(o.token_ids[:2]) for o in engine.generate([prompt] * num, params))

    def distance(a: Counter, b: Counter) -> float:
        return 0.5 * sum(abs(a.get(k, 0) - b.get(k, 0)) for k in set(a) | set(b)) / num

    plain = first_two()
    spec_engine_draws = first_two(speculative_config=SELF_DRAFT)
    assert distance(plain, spec_engine_draws) < 0.08
    # the int8 self-draft samples its guesses from its own q (near p, but not p)
    assert distance(plain, first_two(speculative_config=INT8)) < 0.08
    assert engines[-1].stats()["spec_decode_num_draft_tokens"] >= num     # every request had its second token drafted
    monkeypatch.setattr(rejection_sampler, "recovered_distribution", lambda p, q: p)
    assert distance(plain, first_two(speculative_config=SELF_DRAFT)) > 0.08


# ----------------------------------------------------------------------------------- the automatic k

def test_auto_k_drafts_what_pays_and_stops_where_drafts_lose():
    """The choice maximises expected tokens per second: cheap rows and a good acceptance take every draft allowed;
    falling acceptance lowers k, then turns speculation off for the request (whose estimate drifts up, so
    that it is tried again later); a batch where each row costs its share of the compute (a big batch) runs plain
    decodes; a costly draft model pass is paid for only by a high acceptance; drafts come in runs: how often a
    draft follows an accepted one is learnt by position, over all requests."""
    from minipaged.spec_decode.auto_k import PRIOR_RUN, AutoK, StepCost
    auto = AutoK(StepCost({1: 0.014, 4: 0.0196}))           # a verification of 3 drafts: 1.4x a decode
    for _ in range(4):
        auto.observe_verification("good", 3, 3)
    assert auto.choose({"good": 3}) == {"good": 3}
    ks = []
    for _ in range(12):
        auto.observe_verification("good", 0, 3)
        ks.append(auto.choose({"good": 3})["good"])
    assert ks == sorted(ks, reverse=True) and ks[0] >= 1 and ks[-1] == 0
    back = [auto.choose({"good": 3})["good"] for _ in range(40)]
    assert max(back) >= 1                                   # off, then, its estimate drifting up, tried again
    batch = AutoK(StepCost({16: 0.050, 64: 0.1176}))        # 1.4 ms a row, 28 ms for the weights
    many = {f"r{i}": 3 for i in range(64)}
    assert set(batch.choose(many).values()) == {0}
    few = {f"r{i}": 3 for i in range(16)}
    for rid in few:
        for _ in range(8):
            batch.observe_verification(rid, 3, 3)
    assert set(batch.choose(few).values()) != {0}           # near-certain drafts still pay at 16
    runs = AutoK(StepCost({1: 0.014, 4: 0.0196}))
    for _ in range(10):
        runs.observe_verification(f"r{_}", 0, 3)             # first drafts rejected, by other requests
    runs.acceptance["r"] = 0.9
    assert runs.gains("r", 3) == pytest.approx([0.9, 0.9 * PRIOR_RUN, 0.9 * PRIOR_RUN ** 2])   # no run seen yet
    for _ in range(10):
        runs.observe_verification("q", 1, 3)                 # the first kept, never the second
    assert runs.gains("r", 3)[1] < 0.1 * runs.gains("r", 3)[0] and runs.choose({"r": 3}) == {"r": 1}
    drafting = AutoK(StepCost({1: 0.014, 4: 0.0196}), draft_pass=StepCost({1: 0.007}))
    drafting.acceptance["r"] = 0.3                          # a first draft kept three times in ten
    assert drafting.choose({"r": 3}) == {"r": 0}
    drafting.draft_pass = StepCost({1: 0.001})
    assert drafting.choose({"r": 3})["r"] >= 1
    # a drafting pass timed at batch 16 says little of one at batch 1: kept apart by the requests in it
    drafting.observe_drafting([(16, 0.040)] * 8)
    assert drafting.choose({"r": 3})["r"] >= 1
    fresh = AutoK(StepCost({1: 0.014, 4: 0.0196}), draft_pass=StepCost({16: 0.040}))
    fresh.acceptance["r"] = 0.9
    assert fresh.choose({"r": 3})["r"] >= 1                  # batch 1 not timed yet: tried



def test_auto_k_reads_what_a_row_costs_from_far_apart_steps_not_from_noisy_neighbours():
    """At batch 64 one more row costs a millisecond of a 100 ms step: the step of 65 rows, timed once and 3% slow
    (noise), must not say a row costs 3 ms (the two nearest counts would); a line through the counts seen between
    half and twice the rows says 1.4 ms. With only neighbours seen, the slope is the optimistic prior (drafts get
    tried, and timed)."""
    from minipaged.spec_decode.auto_k import PRIOR_ROW_COST, StepCost
    cost = StepCost()
    for _ in range(30):
        cost.observe(64, 0.028 + 0.0014 * 64)
    cost.observe(65, (0.028 + 0.0014 * 65) * 1.03)
    _intercept, slope = cost.line(64)
    assert slope == pytest.approx(PRIOR_ROW_COST * cost.seconds[64] / 64, rel=0.05)   # neighbours only: the prior
    for rows in (96, 128, 40):
        for _ in range(3):
            cost.observe(rows, 0.028 + 0.0014 * rows)
    _intercept, slope = cost.line(64)
    assert slope == pytest.approx(0.0014, rel=0.1)
    assert cost(80) == pytest.approx(0.028 + 0.0014 * 80, rel=0.02)


def test_auto_k_proposes_and_watches_nothing_where_even_a_certain_draft_loses(tiny_engine_factory):
    """Where every row costs its share of the step (a big batch on a CPU), even a draft that is sure to be accepted
    lowers tokens per second: the automatic k then asks the proposer for nothing, not even the free guesses it
    watches idle requests with, so that turning speculation on costs nothing there."""
    prompts, params = repetitive_prompts(), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = greedy_tokens(tiny_engine_factory(), prompts, params)
    engine = tiny_engine_factory(speculative_config={**NGRAM, "auto_k": True})
    guesses = engine.speculator.proposer = _WrongGuesses()
    pin_step_costs(engine, {8: 0.008, 64: 0.064})       # 1 ms a row, nothing shared
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    assert greedy_tokens(engine, prompts, params) == plain
    assert guesses.proposed == 0
    decodes = [s for e in events for s in e.scheduled if s.kind == "decode"]
    assert decodes and all(s.spec_k == 0 and not s.draft_token_ids for s in decodes)



def test_auto_k_gives_the_rows_that_pay_to_requests_whose_lookup_found_a_guess():
    """The n-gram lookup is made first and the choice is among the requests it found a guess for: a request with
    no match must not take the one draft that pays (it would be a row reserved for a draft that never comes, and
    the step would verify nothing); one whose guess is shorter than k gets no more k than its guess has."""
    from minipaged.request import Request, RequestStatus
    from minipaged.sampling import Sampler
    from minipaged.spec_decode.auto_k import StepCost
    from minipaged.spec_decode.speculator import Speculator
    config = SpeculativeConfig.parse({**NGRAM, "auto_k": True})
    speculator = Speculator(config, NgramProposer(2, 4), 1024, Sampler(0))
    auto = speculator.auto
    auto.cost = StepCost({2: 1.0, 3: 1.3, 4: 1.6})         # a row: 0.3 of a 2-row step; one draft of 0.9 pays
    auto.runs = [0.2]                                        # a second draft rarely follows: one draft only
    auto.acceptance.update({"no-match": 0.95, "match": 0.9})
    no_match = Request("no-match", [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=50), 0, 0.0)
    match = Request("match", [7, 8, 9, 7, 8], SamplingParams(temperature=0, max_tokens=50), 1, 0.0)
    for req in (no_match, match):
        req.status, req.num_computed_tokens, req.output_token_ids = RequestStatus.RUNNING, req.num_tokens, []
    speculator.propose([no_match, match])
    assert (no_match.spec_k, no_match.spec_token_ids) == (0, [])
    assert (match.spec_k, match.spec_token_ids) == (1, [9])

class _WrongGuesses:
    """A proposer whose guesses are never the target's greedy token (one past it, from the step's logits)."""

    def __init__(self) -> None:
        self.proposed = 0

    def propose(self, requests, max_drafts):
        self.proposed += sum(max_drafts.values())
        return {r.request_id: Draft([(r.all_token_ids[-1] * 7 + 1) % 250 + 3] * max_drafts[r.request_id])
                for r in requests if max_drafts[r.request_id]}

    def forget(self, request_id):
        pass


def test_auto_k_turns_losing_speculation_off_and_says_so_in_the_events(tiny_engine_factory):
    """With guesses the target rejects, a fixed k drafts every step; the automatic k soon drafts in few steps,
    keeps greedy outputs, and each decode's record says the k it chose and its acceptance estimate (older
    traces, without the fields, still load). (Step costs pinned: the tiny model's rows cost next to nothing,
    which would make even rare acceptances pay.)"""
    prompt, params = [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = greedy_tokens(tiny_engine_factory(), [prompt], params)
    engine = tiny_engine_factory(speculative_config={**NGRAM, "auto_k": True})
    assert engine.info.speculative.startswith("ngram k<=3 auto")
    engine.speculator.proposer = _WrongGuesses()
    pin_step_costs(engine, {1: 0.014, 4: 0.0196})      # a CPU's at batch one: 3 drafts cost 0.4 of a decode
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    assert greedy_tokens(engine, [prompt], params) == plain
    decodes = [s for e in events for s in e.scheduled if s.kind == "decode"]
    assert all(s.spec_k is not None and 0 <= s.spec_k <= 3 for s in decodes)
    drafted_steps = sum(1 for s in decodes if s.draft_token_ids)
    assert drafted_steps <= len(decodes) // 3, [s.spec_k for s in decodes]
    assert decodes[-1].spec_acceptance is not None and decodes[-1].spec_acceptance < 0.5
    fixed = tiny_engine_factory(speculative_config=NGRAM)
    fixed.speculator.proposer = _WrongGuesses()
    fixed_events: list[StepEvent] = []
    fixed.subscribe(fixed_events.append)
    greedy_tokens(fixed, [prompt], params)
    fixed_decodes = [s for e in fixed_events for s in e.scheduled if s.kind == "decode"]
    assert all(s.spec_k is None for s in fixed_decodes)
    assert all(s.draft_token_ids for s in fixed_decodes[1:-1])      # (the last may draft nothing: max_tokens)
    old = __import__("json").loads(events[-1].to_json())
    for s in old["scheduled"]:
        s.pop("spec_k"), s.pop("spec_acceptance")
    assert StepEvent.from_dict(old).scheduled[0].spec_k is None


class _RightAfter:
    """A proposer that guesses wrong until the text reaches ``position``, then the target's own tokens."""

    def __init__(self, prompt: list[int], tokens: list[int], position: int) -> None:
        self.text, self.position = prompt + tokens, position

    def propose(self, requests, max_drafts):
        out = {}
        for r in requests:
            n, k = r.num_tokens, max_drafts[r.request_id]
            right = self.text[n:n + k]
            out[r.request_id] = Draft(right if n >= self.position else [(t + 1) % 250 + 3 for t in right])
        return {rid: d for rid, d in out.items() if d.token_ids}

    def forget(self, request_id):
        pass


def test_auto_k_watches_an_idle_request_and_drafts_again_once_its_guesses_come_true(tiny_engine_factory):
    """An n-gram guess costs nothing: a request whose drafts lost is still guessed for, and each guess checked
    against the token that comes, so that when the text starts to follow the guesses, drafting resumes."""
    prompt, params = [5, 6, 7, 8, 9, 10], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = greedy_tokens(tiny_engine_factory(), [prompt], params)[0]
    engine = tiny_engine_factory(speculative_config={**NGRAM, "auto_k": True})
    pin_step_costs(engine, {1: 0.014, 4: 0.0196})
    engine.speculator.proposer = _RightAfter(prompt, plain, len(prompt) + 16)
    events: list[StepEvent] = []
    engine.subscribe(events.append)
    assert greedy_tokens(engine, [prompt], params) == [plain]
    decodes = [s for e in events for s in e.scheduled if s.kind == "decode"]
    early = [s for s in decodes if s.start < len(prompt) + 16]
    late = [s for s in decodes if s.start >= len(prompt) + 24]
    assert any(s.spec_k == 0 for s in early)                            # it stopped drafting
    assert sum(len(s.draft_token_ids) for s in late) >= 6 and all(s.num_accepted == len(s.draft_token_ids)
                                                                  for s in late)


def test_prometheus_counters_under_vllms_names_match_the_engine(tiny_engine_factory):
    from prometheus_client.parser import text_string_to_metric_families
    from minipaged.metrics import EngineMetrics
    engine = tiny_engine_factory(speculative_config=NGRAM)
    metrics = EngineMetrics(engine)
    engine.generate(repetitive_prompts(), GREEDY)
    stats = engine.stats()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.exposition()) for s in family.samples}
    assert samples[("minipaged:spec_decode_num_draft_tokens_total", ())] == stats["spec_decode_num_draft_tokens"] > 0
    assert samples[("minipaged:spec_decode_num_accepted_tokens_total", ())] == stats["spec_decode_num_accepted_tokens"] > 0
    assert samples[("minipaged:spec_decode_num_drafts_total", ())] == stats["spec_decode_num_drafts"]
    assert samples[("minipaged:spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == \
        stats["spec_decode_num_accepted_tokens_pos_0"]


def test_cli_generate_speculates_and_reports_acceptance(tiny_model, capsys):
    prompt = "abcabcabcabcabcabcabcabc"
    assert cli_main(["generate", prompt, "--model", tiny_model, "--max-tokens", "20", "--temperature", "0"]) == 0
    plain = capsys.readouterr().out
    assert cli_main(["generate", prompt, "--model", tiny_model, "--max-tokens", "20", "--temperature", "0",
                     "--speculative-model", "self", "--num-speculative-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.out == plain                         # the same answer, streamed
    assert "speculative (self-draft all layers k=3):" in captured.err and "(100%)" in captured.err


def test_speculation_with_parallelism_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="does not combine with tensor or pipeline parallelism"):
        Engine("/nonexistent/model/folder", speculative_config=NGRAM, tensor_parallel_size=2)


def test_the_sampler_samples_chosen_rows_with_the_argmax_it_is_given_as_it_samples_them_copied():
    """A step that verifies drafts samples its plain decodes from their rows in place, with the argmax it worked out
    for every row: the same tokens as sampling a copy of those rows, for greedy and seeded requests alike."""
    from minipaged.request import Request
    from minipaged.sampling import Sampler
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0)]
    rows = [4, 0, 5]

    def requests() -> list[Request]:
        return [Request(f"r{i}", [1, 2, 3], p, i, 0.0) for i, p in enumerate(params)]
    copied = Sampler(0).sample(logits[rows], requests())
    in_place = Sampler(0).sample(logits, requests(), rows=rows, argmax=logits.argmax(-1).tolist())
    assert in_place == copied
    assert in_place[0] == int(logits[4].argmax()) and in_place[2] == int(logits[5].argmax())
    assert Sampler(0).sample(logits, requests(), rows=rows) == copied              # no argmax given: works it out
