"""vLLM's tokenizer routes on a real ``minipaged serve`` (``/tokenize``, ``/detokenize``, ``/tokenizer_info``),
and lm-evaluation-harness's remote tokenizer against them.

One server (tiny random Llama with its byte tokenizer and chat template) serves the module, behind an API key
so that every call also shows the key is honoured; a short context and body limit show the server's limits.
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from serve_util import running_server

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 64
MAX_BODY_BYTES = 16384
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV block?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-tokenize") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "64", "--api-key", KEY,
                        "--max-model-len", str(MAX_MODEL_LEN), "--max-body-bytes", str(MAX_BODY_BYTES),
                        log_path=str(log)) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def post(url: str, path: str, body: dict, headers: dict = AUTH) -> httpx.Response:
    """A body as Python's json writes it (a lone surrogate escaped as \\ud800, which httpx's encoder refuses)."""
    return httpx.post(url + path, content=json.dumps(body), headers={**headers, "Content-Type": "application/json"},
                      timeout=30)


def refused(url: str, path: str, body: dict, status: int = 400) -> dict:
    """The OpenAI-shaped error of a refused call (its message, type, param and code)."""
    response = post(url, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    return error


def test_text_round_trips_through_tokenize_and_detokenize(server, tokenizer, tiny_model):
    text = "The paged KV cache keeps blocks: é, 漢字, and </s> too."
    out = post(server, "/tokenize", {"model": tiny_model, "prompt": text}).json()
    assert out["tokens"] == tokenizer(text).input_ids
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_MODEL_LEN
    assert out["token_strs"] is None                     # only when asked for
    assert post(server, "/detokenize", {"model": tiny_model, "tokens": out["tokens"]}).json() == {"prompt": text}
    # no model (lm-eval sends none) means the served one, as in vLLM
    assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == \
        tokenizer(text, add_special_tokens=False).input_ids


def test_token_strs_are_the_tokenizers_pieces(server, tokenizer):
    out = post(server, "/tokenize", {"prompt": "héllo", "return_token_strs": True}).json()
    assert out["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])
    assert len(out["token_strs"]) == out["count"]


def test_a_text_longer_than_the_context_is_counted_not_refused(server):
    """lm-eval tokenizes whole documents and cuts them into windows itself; count vs max_model_len tells."""
    out = post(server, "/tokenize", {"prompt": "x" * (3 * MAX_MODEL_LEN)}).json()
    assert out["count"] == 3 * MAX_MODEL_LEN > out["max_model_len"]


def test_chat_messages_go_through_the_models_template(server, tokenizer, tiny_model):
    def tokens(**options) -> list[int]:
        response = post(server, "/tokenize", {"model": tiny_model, "messages": CHAT, **options})
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    with_prompt = tokens()                                # vLLM's default: add_generation_prompt true
    assert with_prompt == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"]
    assert tokenizer.decode(with_prompt).endswith("<|assistant|>")
    without = tokens(add_generation_prompt=False)
    assert with_prompt[:len(without)] == without and len(with_prompt) > len(without)
    prefill = CHAT + [{"role": "assistant", "content": "A fixed"}]
    continued = tokens(messages=prefill, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(continued).endswith("<|assistant|>A fixed")
    # what /tokenize counts is what a chat request is charged (one code path: input_processor.render_chat)
    chat = post(server, "/v1/chat/completions", {"model": tiny_model, "messages": CHAT, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == len(with_prompt)
    completion = post(server, "/v1/completions", {"prompt": "a b c", "max_tokens": 1}).json()
    assert completion["usage"]["prompt_tokens"] == post(server, "/tokenize", {"prompt": "a b c"}).json()["count"]


def test_tokenizer_info_has_what_lm_eval_reads(server, tokenizer):
    info = httpx.get(server + "/tokenizer_info", headers=AUTH, timeout=30).json()
    assert info["tokenizer_class"] and info["chat_template"] == tokenizer.chat_template
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("</s>", "<s>", "<pad>")
    assert not any(key.endswith("_file") for key in info)   # no paths on the server's disk


@pytest.mark.parametrize("path, body, param, words", [
    ("/detokenize", {"tokens": [1, -1]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [10**6]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": [2**70]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, "tokens[0]", "valid integer"),
    ("/detokenize", {}, "tokens", "Field required"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens", "Extra inputs"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, "prompt", "both"),
    ("/tokenize", {}, "prompt", "neither"),
    ("/tokenize", {"prompt": [1, 2]}, "prompt", "valid string"),
    ("/tokenize", {"messages": []}, "messages", "at least one message"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "one of"),
    ("/tokenize", {"messages": [{"content": "hi"}]}, "messages[0].role", "Field required"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message",
     "add_generation_prompt"),
    ("/tokenize", {"prompt": "hi", "add_generation_prompt": True}, "add_generation_prompt", "chat option"),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 7 * 7 }}"}, "chat_template", "not supported"),
    ("/tokenize", {"prompt": "hi", "truncate": 3}, "truncate", "Unrecognized request argument"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "Unicode"),
])
def test_bad_input_is_a_400_naming_the_fix(server, path, body, param, words):
    error = refused(server, path, body)
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "BadRequestError"


def test_another_model_is_a_404_and_a_big_body_a_413(server):
    for path, body in (("/tokenize", {"model": "gpt-4", "prompt": "hi"}), ("/detokenize", {"model": "gpt-4",
                                                                                            "tokens": [1]})):
        assert "does not exist" in refused(server, path, body, 404)["message"]
    assert refused(server, "/tokenize", {"prompt": "x" * (2 * MAX_BODY_BYTES)}, 413)["message"]


def test_the_api_key_guards_the_tokenizer_routes(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        for response in (post(server, "/tokenize", {"prompt": "hi"}, headers),
                         post(server, "/detokenize", {"tokens": [1]}, headers),
                         httpx.get(server + "/tokenizer_info", headers=headers, timeout=30)):
            assert response.status_code == 401 and "--api-key" in response.json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=30).status_code == 200


def test_lm_eval_remote_tokenizer_talks_to_the_server(server, tokenizer):
    """lm-evaluation-harness's own client (``tokenizer_backend=remote``), given the completions URL it is given
    for the model and the key as its auth_token."""
    utils = pytest.importorskip("lm_eval.utils")
    base_url = server + "/v1/completions"
    assert utils.check_remote_tokenizer_support(base_url, auth_token=KEY)
    assert not utils.check_remote_tokenizer_support(base_url, auth_token="wrong", max_retries=1)
    remote = utils.RemoteTokenizer(base_url, auth_token=KEY)
    text = "Paged attention, \u00e9t\u00e9."
    assert remote.encode(text) == tokenizer(text, add_special_tokens=False).input_ids
    assert remote.decode(remote.encode(text)) == text
    assert remote.batch_decode([[104, 105], [33]]) == ["hi", "!"]
    assert (remote.eos_token_id, remote.bos_token_id) == (tokenizer.eos_token_id, tokenizer.bos_token_id)
    assert remote.apply_chat_template(CHAT) == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True,
                                                                             tokenize=False)


def test_lm_eval_local_completions_uses_the_remote_tokenizer(server, tokenizer, tiny_model):
    """The model class an evaluation names (``local-completions`` with ``tokenizer_backend=remote``): the token
    ids it scores with, the special ids it takes from the server, and one scored request. Its tokenizer sends
    ``auth_token``; its completions send ``header`` (or OPENAI_API_KEY's value)."""
    pytest.importorskip("lm_eval")
    for package in ("aiohttp", "tenacity", "requests"):           # lm-eval[api]: what its API models need
        pytest.importorskip(package)
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model=tiny_model, base_url=server + "/v1/completions", tokenizer_backend="remote",
                             tokenized_requests=True, auth_token=KEY, header=AUTH, max_retries=1)
    assert lm.tok_encode("a KV block") == tokenizer("a KV block", add_special_tokens=False).input_ids
    assert lm.decode_batch([lm.tok_encode("a KV block")]) == ["a KV block"]
    assert lm.eot_token_id == tokenizer.eos_token_id and lm.prefix_token_id == tokenizer.bos_token_id
    # and a whole scoring request: the remote tokenizer's ids go to /v1/completions as a token-id prompt
    from lm_eval.api.instance import Instance
    (logprob, greedy), = lm.loglikelihood([Instance("loglikelihood", {}, ("The cache", " keeps"), 0)],
                                          disable_tqdm=True)
    assert logprob < 0 and isinstance(greedy, bool)


# ------------------------------------------------------------------------------------ in-process checks

def test_tokenize_answers_while_the_engine_thread_is_inside_a_step(tiny_engine_factory):
    """The tokenizer routes never wait for the engine thread (nor make it wait): with a step held open, they
    still answer."""
    from fastapi.testclient import TestClient

    from minipaged.serve.api_server import ServerSettings, build_app

    engine = tiny_engine_factory()
    gate, stepping = threading.Event(), threading.Event()
    step = engine.step

    def held_step(*args, **kwargs):
        stepping.set()
        gate.wait(30)
        return step(*args, **kwargs)
    engine.step = held_step
    with TestClient(build_app(engine, ServerSettings("tiny"))) as http:
        busy = threading.Thread(target=http.post, args=("/v1/completions",),
                                kwargs={"json": {"prompt": "hi", "max_tokens": 2}})
        busy.start()
        try:
            assert stepping.wait(30), "the engine thread never started a step"
            answers: list = []
            calls = threading.Thread(target=lambda: answers.extend([
                http.post("/tokenize", json={"prompt": "hi"}), http.post("/detokenize", json={"tokens": [104]}),
                http.get("/tokenizer_info")]))
            calls.start()
            calls.join(20)
            assert [a.status_code for a in answers] == [200, 200, 200] and not gate.is_set()
            assert answers[0].json()["tokens"] == [104, 105] and answers[1].json() == {"prompt": "h"}
        finally:
            gate.set()
            busy.join(30)
