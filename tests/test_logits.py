"""The logits stage and log-probabilities, library-level, against transformers on the same tiny weights.

Penalties, biases and masks must pick the tokens transformers' own logits processors pick (greedy, same
prompts); every case also checks that the processor changed the output, so the comparison can fail.
Log-probabilities must be transformers' log_softmax of the same rows (fp32, 1e-4), with the same top-N.
Structured outputs must parse and validate even from a random model at temperature 1, with chunked
prefill, prefix caching, a preemption and n-gram speculation all on.
"""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import (AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                          SuppressTokensLogitsProcessor)

from minipaged import Engine, SamplingParams
from minipaged.request import InvalidRequestError

EOS = 257                  # the tiny byte tokenizer's </s>
PROMPTS = [[72, 101, 108, 108, 111, 32, 104, 101], [84, 104, 101, 32, 99, 97, 116], [1, 2, 3, 1, 2, 3, 1, 2]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(tiny_model, block_size=4, num_blocks=256)


def hf_greedy(hf, prompt: list[int], max_new: int, processors: list) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                      logits_processor=LogitsProcessorList(processors), eos_token_id=EOS, pad_token_id=EOS)
    return out[0, len(prompt):].tolist()


class PresenceFrequency(LogitsProcessor):
    """OpenAI's presence/frequency penalties over the generated tokens (transformers has none of its own)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, input_ids[:, self.prompt_len:], torch.ones_like(input_ids[:, self.prompt_len:],
                                                                              dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


CASES = {
    "repetition_penalty": (dict(repetition_penalty=1.8), lambda p: [RepetitionPenaltyLogitsProcessor(1.8)]),
    "presence_frequency": (dict(presence_penalty=1.5, frequency_penalty=0.7),
                           lambda p: [PresenceFrequency(len(p), 1.5, 0.7)]),
    "logit_bias": (dict(logit_bias={46: 6.0, 92: -100.0, 101: 3.0}),
                   lambda p: [SequenceBiasLogitsProcessor({(46,): 6.0, (92,): -100.0, (101,): 3.0})]),
    "min_tokens": (dict(min_tokens=12, allowed_token_ids=[EOS, 46, 61, 101]),
                   lambda p: [MinNewTokensLengthLogitsProcessor(len(p), 12, EOS),
                              SuppressTokensLogitsProcessor([t for t in range(259) if t not in (EOS, 46, 61, 101)])]),
    "bad_words": (dict(bad_words=["."]), lambda p: [NoBadWordsLogitsProcessor([[46]], eos_token_id=EOS)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_processors_pick_the_tokens_transformers_processors_pick(engine, hf, name):
    fields, reference = CASES[name]
    plain = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16))
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, **fields))
    for prompt, out, before in zip(PROMPTS, outs, plain):
        assert out.token_ids == hf_greedy(hf, prompt, 16, reference(prompt)), (name, prompt)
    assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain)), f"{name} changed nothing: a weak test"


def test_no_processor_means_the_greedy_tokens_of_transformers(engine, hf):
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12, []) for p in PROMPTS]


def hf_logprobs(hf, token_ids: list[int]) -> torch.Tensor:
    """Row i: transformers' log-probabilities for the token after token_ids[:i + 1]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def assert_matches(position: dict, row: torch.Tensor, token: int, top_n: int) -> None:
    assert abs(position[token].logprob - float(row[token])) < 1e-4
    top = torch.topk(row, top_n)
    assert list(position)[:top_n] == top.indices.tolist()
    assert [position[t].logprob for t in list(position)[:top_n]] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert position[token].rank == int((row > row[token]).sum()) + 1


def test_logprobs_and_prompt_logprobs_are_transformers_log_softmax(tiny_model, hf):
    # chunks of 5 tokens, and the second prompt shares a cached prefix that a prompt_logprobs request must not use
    eng = Engine(tiny_model, block_size=4, num_blocks=256, max_num_batched_tokens=5)
    prompt = [ord(c) for c in "prompt logprobs need every row"]
    eng.generate([prompt], SamplingParams(temperature=0, max_tokens=2))            # fills the prefix cache
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=5, prompt_logprobs=3,
                                                ignore_eos=True, repetition_penalty=1.5))[0]
    assert out.num_cached_tokens == 0
    rows = hf_logprobs(hf, prompt + out.token_ids)     # raw: the penalty picks the tokens, not the numbers
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        assert_matches(out.prompt_logprobs[i], rows[i - 1], prompt[i], 3)
    for j, token in enumerate(out.token_ids):
        assert_matches(out.outputs[0].logprobs[j], rows[len(prompt) - 1 + j], token, 5)


def test_logprobs_under_speculation_are_the_targets_raw_rows(tiny_model, hf):
    eng = Engine(tiny_model, block_size=4, num_blocks=256, speculative_config=NGRAM)
    prompt = [97, 98, 99] * 3                                # "abcabcabc": the tiny model repeats itself here
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=30, logprobs=2, ignore_eos=True))[0]
    assert eng.counters["spec_decode_num_accepted_tokens"] > 0
    rows = hf_logprobs(hf, prompt + out.token_ids)
    for j, token in enumerate(out.token_ids):
        assert_matches(out.outputs[0].logprobs[j], rows[len(prompt) - 1 + j], token, 2)


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["ok", "size"], "additionalProperties": False}


SELF_DRAFT = {"method": "draft_model", "model": "self", "num_draft_layers": 1, "num_speculative_tokens": 3}


@pytest.mark.parametrize("speculation", [NGRAM, SELF_DRAFT], ids=["ngram", "draft_model"])
def test_json_schema_outputs_validate_under_chunking_caching_preemption_and_speculation(tiny_model, speculation):
    eng = Engine(tiny_model, block_size=4, num_blocks=40, max_num_batched_tokens=16, max_num_seqs=8,
                 enable_prefix_caching=True, speculative_config=speculation)
    prompt = "Answer in JSON about the weather today, please: "
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=60, structured_outputs={"json": SCHEMA})
              for seed in range(20)]
    outs = eng.generate([prompt] * 20, params)
    for out in outs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert eng.counters["preemptions_recompute"] >= 1, "no preemption happened: shrink num_blocks"
    assert eng.stats()["prefix_cache_hit_rate"] > 0
    assert eng.counters["spec_decode_num_accepted_tokens"] > 0       # drafts were checked against the grammar
    assert len({o.text for o in outs}) > 1                 # sampled, not one forced answer


@pytest.mark.parametrize("structured, check", [
    ({"regex": "[ab]{3}-[0-9]"}, lambda t: len(t) == 5 and set(t[:3]) <= {"a", "b"} and t[3] == "-" and t[4].isdigit()),
    ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
    ({"choice": ["a.b", "(c)|d"]}, lambda t: t in ("a.b", "(c)|d")),           # metacharacters are literal
    ({"grammar": 'root ::= "x" ("y" | "z") "!"'}, lambda t: t in ("xy!", "xz!")),
    ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object(engine, structured, check):
    outs = engine.generate(["q"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=40,
                                                      structured_outputs=structured) for s in range(4)])
    for out in outs:
        if structured.get("json_object") and out.finish_reason == "length":
            continue                                       # any JSON object may be longer than 40 tokens
        assert check(out.text), (structured, out.text)


@pytest.mark.parametrize("structured, words", [
    ({"json": {"type": "nonsense"}}, "invalid structured outputs JSON schema"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "[a-"}, "invalid structured outputs regex"),
    ({"grammar": "root ::= "}, "invalid structured outputs grammar"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
])
def test_bad_structured_outputs_are_refused_before_queueing(engine, structured, words):
    with pytest.raises(InvalidRequestError, match=words):
        engine.add_request("q", SamplingParams(structured_outputs=structured))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("fields, words", [
    (dict(logprobs=-1), "logprobs must be an integer in"), (dict(logprobs=21), "logprobs must be an integer in"),
    (dict(prompt_logprobs=99), "prompt_logprobs"), (dict(presence_penalty=3), "presence_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(logit_bias={1: 500}), "logit_bias"),
    (dict(repetition_penalty=1e-300), r"repetition_penalty must be in \[0.01, 100\]"),   # it overflowed: a 500
    (dict(min_tokens=20, max_tokens=4), "min_tokens"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_logits_fields_name_the_problem(fields, words):
    with pytest.raises(InvalidRequestError, match=words) as refused:
        SamplingParams(**fields)
    assert refused.value.param == next(iter(fields))     # the server answers it as OpenAI's "param"


def test_min_tokens_holds_back_stop_strings_as_vllm_v1_does(tiny_engine_factory):
    """vLLM v1's detokenizer checks stop strings only once the output has more than min_tokens tokens (the stop
    check's start moves past those tokens' text), so min_tokens is a floor for stop strings as for EOS; here a stop
    string in the first token used to end the request at once."""
    engine = tiny_engine_factory()
    prompt = [ord(c) for c in "a stop string early on"]
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    free = engine.generate([prompt], SamplingParams(**greedy))[0]
    first = next(i for i in range(1, 13) if engine.tokenizer.decode(free.token_ids[:i], skip_special_tokens=True))
    stop = engine.tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)[0]
    stopped = engine.generate([prompt], SamplingParams(**greedy, stop=[stop]))[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == first and stopped.text == ""
    min_tokens = first + 3
    held = engine.generate([prompt], SamplingParams(**greedy, stop=[stop], min_tokens=min_tokens))[0]
    assert len(held.token_ids) > min_tokens and held.text.startswith(stop)     # the early one stays in the text
    if held.finish_reason == "stop":           # a later occurrence, completed after the first min_tokens tokens
        assert stop not in held.text[len(engine.tokenizer.decode(held.token_ids[:min_tokens])):]


def test_token_ids_outside_the_vocabulary_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("q", SamplingParams(logit_bias={10_000: 1.0}))


def test_events_carry_probabilities_and_mask_sizes_for_the_tui(engine):
    from minipaged.event_view import EngineView
    from minipaged.events import StepEvent
    from minipaged.tui.state import describe_event
    from minipaged.tui.widgets.output import coloured_output, probability_colour

    events: list[StepEvent] = []
    unsubscribe = engine.subscribe(events.append)
    try:
        asked, masked, plain = engine.generate(["abc", "def", "ghi"], [
            SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=10, structured_outputs={"choice": ["yes", "no"]}),
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])
    finally:
        unsubscribe()
    view, lines = EngineView(engine.info), []
    for ev in events:
        again = StepEvent.from_dict(json.loads(ev.to_json()))     # JSON-serialisable, thin clients read it back
        assert again == ev
        lines += describe_event(again, view)
        view.apply(again)
    rid_asked, rid_masked, rid_plain = asked.request_id, masked.request_id, plain.request_id
    logprobs = [lp for ev in events for lp in ev.new_logprobs.get(rid_asked, [])]
    assert logprobs == pytest.approx([asked.outputs[0].logprobs[i][t].logprob for i, t in enumerate(asked.token_ids)])
    assert not any(rid_plain in ev.new_logprobs for ev in events)
    allowed = [ev.constrained[rid_masked] for ev in events if rid_masked in ev.constrained]
    assert allowed and allowed[0] == (2, engine.logits.vocab_size)       # "y" or "n" first
    assert any("structured-output mask: 2 of 259 tokens allowed" in line.text for line in lines)
    spans = view.requests[rid_asked].text_probs
    assert sum(n for n, _p in spans) == len(asked.text) and not view.requests[rid_plain].text_probs
    rendered = coloured_output(view.requests[rid_asked].text, spans)
    assert {span.style for span in rendered.spans} <= {probability_colour(p) for _n, p in spans}
    assert probability_colour(0.9) != probability_colour(0.001)


def test_the_watch_app_colours_a_selected_requests_output_by_probability(engine, tmp_path):
    """A replayed trace in the real TUI: the output panel of a request that asked for log-probabilities is
    drawn in probability colours, and the event log has the mask line."""
    import asyncio

    from minipaged.trace import read_trace, write_trace_event, write_trace_header
    from minipaged.tui.app import WatchApp
    from minipaged.tui.widgets.event_log import EventLog
    from minipaged.tui.widgets.output import PROBABILITY_COLOURS, OutputPanel

    trace = tmp_path / "trace.jsonl"
    with open(trace, "w") as fp:
        write_trace_header(fp, engine.info)
        unsubscribe = engine.subscribe(lambda ev: write_trace_event(fp, ev))
        try:
            asked, _masked = engine.generate(["abcdef", "xyz"], [
                SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[0-9]{3}"})])
        finally:
            unsubscribe()

    async def run() -> tuple[set[str], str]:
        app = WatchApp(replay=read_trace(str(trace)), paused=True)
        async with app.run_test(size=(140, 44)) as pilot:
            app.go_to(len(app.events))
            app.select(asked.request_id)
            await pilot.pause(0.1)
            panel = app.query_one(OutputPanel)
            styles = {str(seg.style.color.name) for y in range(panel.content_size.height)
                      for seg in panel.render_line(y) if seg.style is not None and seg.style.color is not None}
            log = app.query_one(EventLog)
            return styles, str(log.render())

    styles, log_text = asyncio.run(run())
    assert styles & {colour for _bound, colour in PROBABILITY_COLOURS}, styles
    assert "structured-output mask" in log_text


def test_without_xgrammar_a_structured_request_is_refused_with_the_fix(tiny_model, monkeypatch):
    import sys
    eng = Engine(tiny_model, block_size=4, num_blocks=64)
    monkeypatch.setitem(sys.modules, "xgrammar", None)        # as if it never installed
    with pytest.raises(InvalidRequestError, match="pip install xgrammar"):
        eng.add_request("q", SamplingParams(structured_outputs={"regex": "a"}))
    assert eng.generate("q", SamplingParams(temperature=0, max_tokens=2))[0].finish_reason == "length"
