"""Log-probabilities, echo, several prompts and structured outputs through ``minipaged serve`` and the real
``openai`` client (one server for the module, tiny random Llama). The numbers are checked against
transformers' log_softmax on the same weights; tokens are named by id (vLLM's return_tokens_as_token_ids)
because the byte tokenizer gives many ids the same text.
"""
from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
import torch

from serve_util import openai_client, running_server, wait_until_idle

IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-logits") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "512", "--max-num-batched-tokens", "8",
                        log_path=str(log)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def hf_rows(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def token_id(name: str) -> int:
    assert name.startswith("token_id:"), name
    return int(name[len("token_id:"):])


def test_echo_scores_every_prompt_token_as_transformers_does(client, model_name, hf, tokenizer):
    prompt = "Paged attention reads blocks"             # longer than one 8-token chunk: chunked prefill
    ids = tokenizer(prompt).input_ids
    response = client.completions.create(model=model_name, prompt=prompt, echo=True, logprobs=5, max_tokens=1,
                                         temperature=0, extra_body=IDS)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and [token_id(t) for t in lp.tokens[:len(ids)]] == ids
    assert response.choices[0].text.startswith(prompt)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = hf_rows(hf, ids + [token_id(lp.tokens[-1])])
    for i in range(1, len(ids) + 1):
        token = token_id(lp.tokens[i])
        assert abs(lp.token_logprobs[i] - float(rows[i - 1, token])) < 1e-4
        top = torch.topk(rows[i - 1], 5)
        got = {token_id(t): v for t, v in lp.top_logprobs[i].items()}
        assert list(got)[:5] == top.indices.tolist()
        assert [got[t] for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert response.usage.completion_tokens == 1


def test_echo_with_max_tokens_0_returns_the_scored_prompt_only(client, model_name, tokenizer):
    prompt = "Score me"
    response = client.completions.create(model=model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=0,
                                         extra_body=IDS)
    choice = response.choices[0]
    assert choice.text == prompt and len(choice.logprobs.tokens) == len(tokenizer(prompt).input_ids)
    assert response.usage.completion_tokens == 0


def test_chat_top_logprobs_are_transformers_log_softmax(client, model_name, hf, tokenizer):
    messages = [{"role": "user", "content": "Say something"}]
    response = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=5,
                                              extra_body={**IDS, "ignore_eos": True, "prompt_logprobs": 1})
    content = response.choices[0].logprobs.content
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
    prompt_logprobs = response.model_extra["prompt_logprobs"]             # vLLM's field, beside the choices
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    generated = [token_id(c.token) for c in content]
    assert len(generated) == 6
    rows = hf_rows(hf, list(prompt_ids) + generated)
    for j, entry in enumerate(content):
        row = rows[len(prompt_ids) - 1 + j]
        assert abs(entry.logprob - float(row[generated[j]])) < 1e-4
        top = torch.topk(row, 5)
        assert [token_id(t.token) for t in entry.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
    streamed = client.chat.completions.create(model=model_name, messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=5, stream=True,
                                              extra_body={**IDS, "ignore_eos": True})
    streamed_content = [c for chunk in streamed for choice in chunk.choices if choice.logprobs
                        for c in choice.logprobs.content]
    assert [c.token for c in streamed_content] == [c.token for c in content]
    assert [c.logprob for c in streamed_content] == pytest.approx([c.logprob for c in content], abs=1e-4)


def test_three_prompts_with_n_2_give_six_indexed_choices(client, model_name):
    prompts = ["one", "two", "three"]
    response = client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert sorted(c.index for c in response.choices) == list(range(6))
    by_index = {c.index: c.text for c in response.choices}
    for i, prompt in enumerate(prompts):
        alone = client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
        assert by_index[2 * i] == by_index[2 * i + 1] == alone       # greedy: both samples are the same
    assert response.usage.completion_tokens == 18
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(model=model_name, prompt=prompts, n=2, max_tokens=3, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == by_index


def test_response_format_json_schema_and_stop_token_ids(client, model_name):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    response = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "json please"}], max_tokens=30, temperature=1,
        seed=3, response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    choice = client.completions.create(model=model_name, prompt="x", max_tokens=10,
                                       extra_body={"structured_outputs": {"choice": ["ab", "cd"]}}).choices[0]
    assert choice.text in ("ab", "cd")
    stopped = client.completions.create(model=model_name, prompt="x", max_tokens=10,
                                        extra_body={"structured_outputs": {"regex": "abc"},
                                                    "stop_token_ids": [ord("b")]}).choices[0]
    assert stopped.text == "ab" and stopped.finish_reason == "stop" and stopped.stop_reason == ord("b")


def test_bad_values_are_openai_400s_while_a_stream_goes_on(server, client, model_name):
    got: dict = {}

    def long_stream() -> None:
        chunks = list(client.completions.create(model=model_name, prompt="keep going", max_tokens=2000, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}))
        got["n"] = chunks[-1].usage.completion_tokens

    worker = threading.Thread(target=long_stream)
    worker.start()
    base = {"model": model_name, "prompt": "hi", "max_tokens": 4}
    chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    bad = [("/v1/completions", {**base, "logprobs": -1}, "logprobs"),
           ("/v1/completions", {**base, "logprobs": 50}, "logprobs must be an integer from 0 to 20"),
           ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
           ("/v1/completions", {**base, "response_format": {"type": "json_schema", "json_schema": {
               "name": "x", "schema": {"type": "nonsense"}}}}, "invalid structured outputs JSON schema"),
           ("/v1/completions", {**base, "structured_outputs": {"regex": "[a-"}}, "regex"),
           ("/v1/completions", {**base, "presence_penalty": 5}, "presence_penalty"),
           ("/v1/completions", {**base, "logit_bias": {"999999": 1}}, "outside the vocabulary"),
           ("/v1/chat/completions", {**chat, "max_tokens": None, "min_tokens": 9999}, "min_tokens must be")]
    for path, body, words in bad:
        response = httpx.post(server + path, json=body, timeout=30)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert words in error["message"] and error["type"] == "BadRequestError", (body, error)
    assert worker.is_alive(), "the stream ended before the bad requests were sent; make it longer"
    worker.join(60)
    assert got["n"] == 2000
    wait_until_idle(server)


@pytest.mark.parametrize("max_tokens", [4, 1, 0])   # 1 and 0 (echo alone): the request ends in its first delta
def test_streamed_echo_and_logprobs_match_the_whole_response(client, model_name, max_tokens):
    args = dict(model=model_name, prompt=["first prompt", "second one"], echo=True, logprobs=3, max_tokens=max_tokens,
                temperature=0, extra_body={**IDS, "ignore_eos": True})
    whole = {c.index: c for c in client.completions.create(**args).choices}
    tokens: dict[int, list] = {}
    values: dict[int, list] = {}
    text: dict[int, str] = {}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + c.text
            if c.logprobs is not None:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                values.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    assert sorted(whole) == sorted(text) == [0, 1]
    for index, choice in whole.items():
        assert text[index] == choice.text and tokens[index] == choice.logprobs.tokens
        assert values[index][0] is None and None not in values[index][1:]       # the prompt's positions too
        assert values[index][1:] == pytest.approx(choice.logprobs.token_logprobs[1:], abs=1e-4)


def test_prompt_logprobs_and_n_samples_with_a_grammar(client, model_name):
    response = client.completions.create(model=model_name, prompt="abc", max_tokens=5, n=3, temperature=1, seed=1,
                                         extra_body={"prompt_logprobs": 2, "structured_outputs": {"regex": "[xy]{5}"}})
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    for c in response.choices:
        assert len(c.text) == 5 and set(c.text) <= {"x", "y"}
        prompt_logprobs = c.model_extra["prompt_logprobs"]
        assert prompt_logprobs[0] is None and len(prompt_logprobs) == 3
        assert all(entry["rank"] >= 1 for position in prompt_logprobs[1:] for entry in position.values())
