"""SamplingParams.output_kind (vLLM's RequestOutputKind): a "delta" request's final RequestOutput does not repeat
what its step deltas carried (every token, its text and log-probabilities), so that the engine core does not send
a long streamed answer twice nor keep its log-probabilities; ``serve`` asks it for streamed requests only."""
from __future__ import annotations

import pytest

from minipaged import SamplingParams
from minipaged.request import InvalidRequestError


def run(engine, prompt: list[int], params: SamplingParams):
    """The request's deltas joined per sample (text, tokens, log-probabilities), its prompt log-probabilities
    from its first delta, and its final RequestOutput."""
    rid = engine.add_request(prompt, params)
    joined: dict[int, dict[str, list]] = {}
    prompt_logprobs, final = None, None
    while engine.has_unfinished_requests():
        for delta in engine.step().outputs:
            assert delta.request_id == rid
            prompt_logprobs = prompt_logprobs or delta.prompt_logprobs
            for sample in delta.samples:
                into = joined.setdefault(sample.index, {"text": [], "tokens": [], "logprobs": []})
                into["text"].append(sample.text)
                into["tokens"].extend(sample.token_ids)
                into["logprobs"].extend(sample.logprobs)
            final = delta.output or final
    return joined, prompt_logprobs, final


def test_a_delta_request_gets_the_same_deltas_and_a_final_output_without_them(tiny_engine_factory):
    engine = tiny_engine_factory()
    prompt = [5, 9, 13, 2, 7, 11, 3]
    asked = dict(n=3, temperature=0.8, seed=4, max_tokens=12, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    cumulative, cumulative_prompt, whole = run(engine, prompt, SamplingParams(**asked))
    delta, delta_prompt, ending = run(engine, prompt, SamplingParams(**asked, output_kind="delta"))
    # the stream is the same either way: every token, its text and log-probabilities, the prompt's first
    assert delta == cumulative and delta_prompt == cumulative_prompt and delta_prompt
    # "cumulative": the final output repeats all of it; "delta": only how each sample ended, and its count
    for c in whole.outputs:
        assert c.token_ids == cumulative[c.index]["tokens"] and c.text == "".join(cumulative[c.index]["text"])
        assert c.logprobs == cumulative[c.index]["logprobs"] and c.num_tokens == len(c.token_ids) == 12
    assert whole.prompt_logprobs == cumulative_prompt
    for c, full in zip(ending.outputs, whole.outputs):
        assert (c.text, c.token_ids, c.token_times, c.logprobs) == ("", [], [], None)
        assert (c.index, c.finish_reason, c.stop_reason, c.num_tokens) == \
            (full.index, full.finish_reason, full.stop_reason, full.num_tokens)
    assert ending.prompt_logprobs is None and ending.prompt_token_ids == prompt


def test_a_delta_request_that_ends_in_its_first_delta_still_gets_its_prompt_logprobs(tiny_engine_factory):
    engine = tiny_engine_factory()
    asked = dict(n=2, temperature=0.8, seed=1, max_tokens=1, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    prompt = [5, 9, 13, 2, 7, 11, 3]
    _, cumulative_prompt, _ = run(engine, prompt, SamplingParams(**asked))
    _, delta_prompt, _ = run(engine, prompt, SamplingParams(**asked, output_kind="delta"))
    assert delta_prompt == cumulative_prompt and len(delta_prompt) == len(prompt)


def test_output_kind_is_checked_and_serve_asks_delta_for_streams_only(tiny_engine_factory):
    with pytest.raises(InvalidRequestError, match="output_kind must be one of cumulative, delta, got 'final'"):
        SamplingParams(output_kind="final")
    with pytest.raises(InvalidRequestError, match="generate returns whole outputs: leave output_kind 'cumulative'"):
        tiny_engine_factory().generate([[1, 2, 3]], SamplingParams(output_kind="delta"))
    from minipaged.serve.protocol import ChatCompletionRequest, CompletionRequest

    messages = [{"role": "user", "content": "hi"}]
    for stream, kind in ((True, "delta"), (False, "cumulative"), (None, "cumulative")):
        extra = {} if stream is None else {"stream": stream}
        assert ChatCompletionRequest(model="m", messages=messages, **extra).sampling_params(4).output_kind == kind
        assert CompletionRequest(model="m", prompt="hi", **extra).sampling_params(4).output_kind == kind
