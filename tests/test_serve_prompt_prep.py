"""issue 48, item 2: nothing of a request's preparation runs on the engine's step loop (a real ``serve`` subprocess).

A prompt of a few MB used to be tokenised on the engine thread before its length was refused, pausing every
other stream for seconds; now a text longer than the context could ever hold is refused by its length in
characters, and every prompt that passes is tokenised on a worker thread before the engine sees it. The tokens
must be the very ones the engine makes itself, and a refused page prompt still counts against the page's rate.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from serve_util import running_server, victim_stream

MAX_BODY = 6 << 20
PAGE_RATE = 2
BIG_TEXT = "word " * 600_000                 # 3 MB: seconds of tokenising


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-prompt-prep") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "1024", "--max-num-seqs", "8",
                        "--max-body-bytes", str(MAX_BODY), "--page-prompt-rate", str(PAGE_RATE),
                        log_path=str(log)) as url:
        yield url


def post(url: str, path: str, body: dict, client: httpx.Client | None = None) -> httpx.Response:
    send = client.post if client is not None else httpx.post
    return send(url + path, content=json.dumps(body).encode(), headers={"content-type": "application/json"},
                timeout=120)


def error_of(response: httpx.Response, status: int, *words: str) -> dict:
    assert response.status_code == status, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == status and all(w in error["message"] for w in words), error
    return error


def test_the_server_makes_the_engines_own_tokens_for_prompts_ids_echo_and_a_chat(server, tiny_engine_factory):
    """Tokenising moved off the engine thread: the same tokens (usage.prompt_tokens) and the same greedy output as
    the engine in-process, which tokenises for itself."""
    from minipaged import SamplingParams
    engine = tiny_engine_factory()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["Paged attention maps", "héllo wörld </s> with a special token", "  two  spaces\nand a line"]
    for prompt, expected in zip(prompts, engine.generate(prompts, params)):
        got = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                               "ignore_eos": True}).json()
        assert got["usage"]["prompt_tokens"] == len(expected.prompt_token_ids), (prompt, got)
        assert got["choices"][0]["text"] == expected.outputs[0].text, prompt
    ids = [72, 101, 108, 108, 111, 33]
    echoed = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True,
                                              "ignore_eos": True}).json()
    expected = engine.generate([ids], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert echoed["usage"]["prompt_tokens"] == len(ids)
    assert echoed["choices"][0]["text"] == engine.tokenizer.decode(ids) + expected.outputs[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV block?"}]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 8, "temperature": 0,
                                                 "ignore_eos": True}).json()
    expected = engine.chat(messages, params)[0]
    assert chat["usage"]["prompt_tokens"] == len(expected.prompt_token_ids)
    assert chat["choices"][0]["message"]["content"] == expected.outputs[0].text


def test_a_prompt_that_fits_is_not_refused_by_the_length_bound(server):
    """The character bound is generous: a text of the context's length less a few tokens (one byte a token
    here) is served; one a little longer is refused by its token count, as vLLM words it."""
    fits = post(server, "/v1/completions", {"prompt": "a" * 2040, "max_tokens": 1})
    assert fits.status_code == 200, fits.text
    over = post(server, "/v1/completions", {"prompt": "a" * 2100, "max_tokens": 1})
    error_of(over, 400, "maximum context length is 2048 tokens", "in the messages")


def test_multi_mb_prompts_are_refused_by_length_without_pausing_another_clients_stream(server, tiny_model):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    started = time.perf_counter()
    tokenizer(BIG_TEXT)
    tokenising_s = time.perf_counter() - started       # what the engine thread used to spend on each big prompt
    stop, times, errors = threading.Event(), [], []
    victim = threading.Thread(target=victim_stream, args=(server, stop, times, errors))
    victim.start()
    try:
        deadline = time.monotonic() + 60
        while len(times) < 5:
            assert time.monotonic() < deadline and not errors, errors
            time.sleep(0.01)
        attack_began = time.monotonic()
        for _ in range(2):
            error = error_of(post(server, "/v1/completions", {"prompt": BIG_TEXT, "max_tokens": 4}), 400,
                             "maximum context length is 2048 tokens", f"{len(BIG_TEXT)} characters",
                             "reduce the length of the prompt")
            assert error["param"] == "prompt"
            error = error_of(post(server, "/v1/chat/completions",
                                  {"messages": [{"role": "user", "content": BIG_TEXT}], "max_tokens": 4}), 400,
                             "maximum context length", "characters")
            assert error["param"] == "messages"
            error_of(post(server, "/v1/completions", {"prompt": [1] * 400_000, "max_tokens": 4}), 400,
                     "maximum context length is 2048 tokens")
            error_of(post(server, "/v1/completions", {"prompt": BIG_TEXT * 3, "max_tokens": 4}), 413,
                     "--max-body-bytes", str(MAX_BODY))
        attack_ended = time.monotonic()
        time.sleep(0.3)
    finally:
        stop.set()
        victim.join(60)
    assert not errors, errors
    during = [t for t in times if attack_began <= t <= attack_ended + 0.3]
    gaps = [b - a for a, b in zip(during, during[1:])]
    assert len(during) > 3 and max(gaps) < tokenising_s / 2, (
        f"the victim waited {max(gaps):.2f} s for a token while big prompts were refused; tokenising one takes "
        f"{tokenising_s:.2f} s")


def test_a_refused_page_prompt_counts_against_the_rate(server):
    """A page prompt refused for itself (too long) keeps its place in the rate: given back, a student could send
    it (and the server tokenise it) without end. A student of their own address, so other tests do not count."""
    with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.4"), timeout=60) as student:
        for _ in range(PAGE_RATE):
            error_of(post(server, "/v1/page/prompt", {"prompt": "word " * 3000}, student), 400,
                     "maximum context length")
        limited = post(server, "/v1/page/prompt", {"prompt": "word " * 3000}, student)
        error_of(limited, 429, f"{PAGE_RATE} a minute", "--page-prompt-rate")
        assert int(limited.headers["Retry-After"]) >= 1
