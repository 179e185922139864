"""A worker a router can speak to (issue 38): the fields sglang-router adds to every body it forwards are
honoured (skip_special_tokens, no_stop_trim, continue_final_message, ignore_eos) or accepted without effect;
``/server_info``, ``/model_info`` and ``/get_load`` answer in SGLang's shapes with the engine's real numbers;
a missing model, or the router's ``"unknown"``, means the one model served.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from serve_util import running_server, wait_until_idle

# What sglang-router 0.3.2 adds to a chat body it forwards (read from a worker that logged it).
ROUTER_FIELDS = {"no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                 "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("router-worker") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "160", "--served-model-name", "tiny",
                        log_path=str(log)) as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def completion_text(url: str, **body) -> str:
    answer = post(url, "/v1/completions", {"temperature": 0, **body})
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_the_router_s_bodies_pass_with_or_without_a_model_name(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4, **ROUTER_FIELDS}
    for model in ("unknown", "tiny", None, ""):
        body = {**chat, "model": model} if model is not None else chat
        answer = post(server, "/v1/chat/completions", body)
        assert answer.status_code == 200, (model, answer.text)
        assert answer.json()["model"] == "tiny"
    completion = {"prompt": "hello", "max_tokens": 4, "model": "unknown", **ROUTER_FIELDS}
    del completion["continue_final_message"]
    assert post(server, "/v1/completions", completion).status_code == 200
    other = post(server, "/v1/completions", {**completion, "model": "gpt-4"})
    assert other.status_code == 404 and "`tiny`" in other.json()["error"]["message"]


def test_fields_without_a_meaning_here_are_refused_when_they_ask_for_something(server):
    hidden = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "return_hidden_states": True})
    assert hidden.status_code == 400 and hidden.json()["error"]["param"] == "return_hidden_states"
    cont = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "continue_final_message": True})
    assert cont.status_code == 400 and "chat option" in cont.json()["error"]["message"]


def test_skip_special_tokens_false_keeps_them_in_the_text(server):
    eos = AutoTokenizer.from_pretrained(server_model(server)).eos_token_id
    forced = {"prompt": "a", "max_tokens": 3, "ignore_eos": True, "allowed_token_ids": [eos]}
    assert completion_text(server, **forced) == ""
    assert completion_text(server, **forced, skip_special_tokens=False) == "</s>" * 3


def test_no_stop_trim_keeps_the_stop_string(server):
    full = completion_text(server, prompt="stop here", max_tokens=12, ignore_eos=True)
    stop = next(full[i:i + 2] for i in range(2, len(full) - 2) if full[i:i + 2].strip() and
                full.find(full[i:i + 2]) == i)
    cut = completion_text(server, prompt="stop here", max_tokens=12, ignore_eos=True, stop=[stop])
    kept = completion_text(server, prompt="stop here", max_tokens=12, ignore_eos=True, stop=[stop], no_stop_trim=True)
    assert cut == full[:full.find(stop)]
    assert kept == cut + stop


def test_continue_final_message_continues_the_assistant_s_turn(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    tokenizer = AutoTokenizer.from_pretrained(server_model(server))
    open_turn = tokenizer.apply_chat_template(messages, continue_final_message=True, add_generation_prompt=False,
                                              tokenize=True, return_dict=True)["input_ids"]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0,
                                                 "ignore_eos": True, "continue_final_message": True}).json()
    assert chat["usage"]["prompt_tokens"] == len(open_turn)
    assert chat["choices"][0]["message"]["content"] == completion_text(server, prompt=list(open_turn), max_tokens=6,
                                                                       ignore_eos=True)


def test_info_routes_and_the_load_a_router_polls(server):
    info = httpx.get(server + "/server_info", timeout=5).json()
    assert info["served_model_name"] == "tiny" and info["num_blocks"] == 160 and info["block_size"] == 4
    assert httpx.get(server + "/get_server_info", timeout=5).json() == info
    model = httpx.get(server + "/model_info", timeout=5).json()
    assert model["is_generation"] is True and model["served_model_name"] == "tiny"
    wait_until_idle(server)
    assert httpx.get(server + "/get_load", timeout=5).json() == [
        {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    # A long request running: the load counts it and the KV it holds.
    sender = threading.Thread(target=completion_text, args=(server,),
                              kwargs=dict(prompt="load " * 8, max_tokens=400, ignore_eos=True))
    sender.start()
    seen = None
    deadline = time.monotonic() + 30
    while sender.is_alive() and time.monotonic() < deadline:
        load = httpx.get(server + "/get_load", timeout=5).json()[0]
        if load["num_reqs"] >= 1 and load["num_tokens"] > 0:
            seen = load
            break
        time.sleep(0.005)
    sender.join(60)
    assert seen is not None, "/get_load never showed the running request"
    assert seen["num_tokens"] % 4 == 0 and seen["num_tokens"] >= 40      # its prompt's blocks at least


def server_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["root"]
