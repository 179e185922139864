"""issue 39, library level: one request's failure fails that request only, and nothing slow for one request
runs on the step loop (grammar compilation, bad-word tables). The same cases against a live server, with a
victim stream beside them, are in test_serve_isolation.py."""
from __future__ import annotations

import threading
import time

import pytest

from minipaged import SamplingParams
from minipaged.logits import processors as processors_module
from minipaged.request import InvalidRequestError, RequestStatus
from tests.conftest import step_until_done

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture
def engine(tiny_engine_factory):
    eng = tiny_engine_factory()
    yield eng
    assert eng.kv.num_free_blocks == eng.kv.num_blocks        # nothing leaked, whatever failed
    eng.kv.check_invariants()


@pytest.mark.parametrize("fields, param, words", [
    (dict(stop_token_ids=[999_999], min_tokens=2), "stop_token_ids", r"outside the vocabulary \(0..258\)"),
    (dict(stop_token_ids=[10**30]), "stop_token_ids", "int64"),
    (dict(logit_bias={"99999999999999999999999": 1}), "logit_bias", "int64"),
    (dict(logit_bias={300: 1}), "logit_bias", "outside the vocabulary"),
    (dict(allowed_token_ids=[5, 259]), "allowed_token_ids", "outside the vocabulary"),
    (dict(structured_outputs={"choices": ["a"]}), "structured_outputs.choices", "no field 'choices'"),
])
def test_every_token_id_field_is_checked_before_queueing_and_names_the_field(engine, fields, param, words):
    with pytest.raises(InvalidRequestError, match=words) as info:
        engine.add_request("q", SamplingParams(**fields))
    assert info.value.param == param
    assert not engine.has_unfinished_requests()


def test_a_processor_that_raises_fails_its_request_only(engine, monkeypatch):
    alone = engine.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(**GREEDY))

    def broken(self, logits, prompt_token_ids, output_token_ids):
        if len(output_token_ids) == 2:
            raise IndexError("index 999999 is out of bounds")
    monkeypatch.setattr(processors_module.LogitBias, "apply", broken)
    outputs = engine.generate([[1, 2, 3], [7, 8, 9], [4, 5, 6]],
                              [SamplingParams(**GREEDY), SamplingParams(**GREEDY, logit_bias={5: 1.0}),
                               SamplingParams(**GREEDY)])
    failed = outputs[1].outputs[0]
    assert failed.finish_reason == "abort" and len(failed.token_ids) == 2
    assert "IndexError: index 999999 is out of bounds" in failed.error
    assert [outputs[0].token_ids, outputs[2].token_ids] == [o.token_ids for o in alone]   # untouched
    assert outputs[0].outputs[0].error is None


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_constraints_that_allow_no_token_end_the_request_with_the_reason(engine, temperature):
    out = engine.generate([[1, 2, 3]], SamplingParams(temperature=temperature, max_tokens=4, seed=0,
                                                      allowed_token_ids=[97], bad_words=["a"]))[0].outputs[0]
    assert out.finish_reason == "abort" and out.token_ids == []          # not token 0 with a 200
    assert "no token is allowed" in out.error and "AllowedTokens" in out.error and "BadWords" in out.error


def test_a_grammar_compiles_off_the_step_loop_once_per_spec_and_times_out(engine, monkeypatch):
    compiler = engine.logits.compiler
    release = threading.Event()
    calls = []
    real = compiler._grammar_compiler()          # built here, so the slow one below can hand it the work

    class Slow:                          # xgrammar's compiler, held until the test lets it go
        def compile_grammar(self, grammar):
            calls.append(grammar)
            release.wait(30)
            return real.compile_grammar(grammar)
    monkeypatch.setattr(compiler, "_compiler", Slow())
    other = engine.add_request([1, 2, 3], SamplingParams(**GREEDY))
    choice = SamplingParams(temperature=0, max_tokens=6, structured_outputs={"choice": ["yes", "no"]})
    first = engine.add_request([4, 5], choice)
    second = engine.add_request([6, 7], choice)                    # the same spec: the same compilation
    steps = 0
    while engine.outputs.unfinished(other):                        # the other request runs to its end meanwhile
        engine.step()
        steps += 1
    assert steps >= GREEDY["max_tokens"] and len(calls) <= 1
    assert [r.status for r in engine.outputs.unfinished(first) + engine.outputs.unfinished(second)] == \
        [RequestStatus.WAITING_FOR_GRAMMAR] * 2
    release.set()
    outputs = step_until_done(engine)
    assert {outputs[rid].text for rid in (first, second)} <= {"yes", "no"}
    assert len(calls) == 1
    # A grammar still compiling past the limit fails its request with a message that says which limit.
    release.clear()
    compiler.timeout_s = 0.2
    late = engine.add_request([8], SamplingParams(max_tokens=3, structured_outputs={"regex": "[0-9]{4}"}))
    start = time.monotonic()
    out = step_until_done(engine)[late].outputs[0]
    release.set()
    assert out.finish_reason == "abort" and "--grammar-timeout" in out.error and time.monotonic() - start < 5


def test_bad_words_of_n_samples_are_tokenised_once_and_looked_up_by_prefix(engine, monkeypatch):
    tokenizer = engine.logits.tokenizer
    batches = []
    real_call = type(tokenizer).__call__
    monkeypatch.setattr(type(tokenizer), "__call__",
                        lambda self, text, **kw: (batches.append(text), real_call(self, text, **kw))[1])
    words = [f"w{i}q" for i in range(2000)] + ["e"]
    outputs = engine.generate([[1, 2, 3]], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12,
                                                          ignore_eos=True, bad_words=words))[0].outputs
    assert len([b for b in batches if isinstance(b, list)]) == 1     # one batched call for the 4 samples
    assert all(ord("e") not in o.token_ids for o in outputs)
    table = processors_module.BadWordTable.build(words, tokenizer, engine.logits.vocab_size)
    # each word as written and after a space; "e" alone is one token, banned everywhere
    assert sum(len(v) for by in table.by_prefix.values() for v in by.values()) == 4001
    assert table.always.tolist() == [ord("e")]


def test_a_request_whose_text_cannot_be_made_ends_alone(engine):
    """Detokenizing is per request too: a tokenizer that raises on one request's ids aborts that request with
    the reason; the others run to their ends and every block comes back."""
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    good = engine.add_request([1, 2, 3], greedy)
    bad = engine.add_request([4, 5, 6], greedy)
    state = engine.outputs._states[bad]

    def broken(_tokens):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
    state.detokenizer.add_tokens = broken
    outputs = step_until_done(engine)
    assert outputs[good].finish_reason == "length" and len(outputs[good].token_ids) == 5
    failed = outputs[bad].outputs[0]
    assert failed.finish_reason == "abort" and "turning its tokens into text failed" in failed.error
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
