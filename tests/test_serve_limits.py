"""issue 30: ``minipaged serve`` under abuse, on one real server subprocess (tiny model, 127.0.0.1, a free port).

One test per defect the adversarial pass found (numbered as in the issue), each of which failed on the code
before the fix, and the two load cases kept as regressions (200 streams with 50 disconnects; a flood against
--max-waiting-requests is in test_serve.py). Lifecycle cases (kill -9, SIGSTOP, SIGTERM) start their own
servers: see test_serve_lifecycle.py.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import typing

import httpx
import openai
import pytest

from serve_util import openai_client, running_server, wait_until_idle

MAX_WAITING = 1000
MAX_N = 1000
MAX_BODY = 65536
HEARTBEAT_S = 0.5


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-limits") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "4096", "--max-num-seqs", "8",
                        "--max-waiting-requests", str(MAX_WAITING), "--max-n", str(MAX_N),
                        "--max-body-bytes", str(MAX_BODY), "--event-heartbeat-s", str(HEARTBEAT_S),
                        log_path=str(log)) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def error_of(response: httpx.Response, status: int) -> dict:
    """The error object of an OpenAI-shaped error response (nothing but ``{"error": {...}}``)."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status, error
    return error


def post(server: str, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(server + path, json=body, timeout=30, **kwargs)


def raw_post(server: str, path: str, body: dict) -> httpx.Response:
    """A body as Python's json writes it (lone surrogates escaped as \\ud800, which httpx's encoder refuses)."""
    return httpx.post(server + path, content=json.dumps(body).encode(), timeout=30,
                      headers={"content-type": "application/json"})


# ------------------------------------------------------------------------------ 1. n and the cost of aborts

def test_1_n_is_bounded_and_a_thousand_sample_abort_leaves_the_server_responsive(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="a", n=MAX_N + 1, max_tokens=1)
    error = info.value.body
    assert error["param"] == "n" and "--max-n" in error["message"] and str(MAX_N) in error["message"]

    got: dict = {}

    def other() -> None:
        out = client.completions.create(model=model_name, prompt="beside a crowd", max_tokens=300, temperature=0,
                                        extra_body={"ignore_eos": True})
        got["tokens"] = out.usage.completion_tokens

    wait_until_idle(server)
    worker = threading.Thread(target=other)             # running before the crowd comes, and after it leaves
    worker.start()
    deadline = time.monotonic() + 20
    while httpx.get(server + "/health").json()["num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    body = {"model": model_name, "prompt": "a", "n": MAX_N - 8, "max_tokens": 50, "ignore_eos": True,
            "stream": True, "temperature": 1.0}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    # the client hung up on ~1,000 samples: the abort must not stall the engine thread
    worker.join(60)
    assert got.get("tokens") == 300
    start = time.monotonic()
    health = wait_until_idle(server, timeout=30)
    assert health["blocks_free"] == health["blocks_total"]
    quick = client.completions.create(model=model_name, prompt="after", max_tokens=3)
    assert quick.usage.completion_tokens >= 1
    assert time.monotonic() - start < 30


# ------------------------------------------------------------------------------ 2. admission counts samples

def test_2_admission_counts_samples_and_health_says_when_the_queue_is_full(server, model_name):
    wait_until_idle(server)
    streams: list = []

    def open_stream(n: int, prompt: str) -> httpx.Response:
        http = httpx.Client(timeout=30)
        body = {"model": model_name, "prompt": prompt, "n": n, "max_tokens": 1500, "ignore_eos": True,
                "stream": True}
        response = http.send(http.build_request("POST", server + "/v1/completions", json=body), stream=True)
        streams.append((http, response))
        return response

    try:
        assert open_stream(600, "six hundred").status_code == 200
        deadline = time.monotonic() + 20
        while httpx.get(server + "/health").json()["num_requests_waiting"] < 500:
            assert time.monotonic() < deadline, "the 600 samples never showed up as waiting"
            time.sleep(0.05)
        # one request, but 500 more samples: over the limit of 1000 with ~592 waiting
        busy = post(server, "/v1/completions", {"model": model_name, "prompt": "b", "n": 500, "max_tokens": 2})
        error = error_of(busy, 503)
        assert "samples" in error["message"] and "--max-waiting-requests" in error["message"]
        assert busy.headers["retry-after"] == "1"
        assert open_stream(1, "a plain one").status_code == 200       # it still fits
        waiting = httpx.get(server + "/health").json()["num_requests_waiting"]
        assert open_stream(MAX_WAITING - waiting, "the rest").status_code == 200
        health = httpx.get(server + "/health")
        assert health.status_code == 503 and "queue is full" in health.json()["reason"], health.text
        assert "--max-waiting-requests" in health.json()["reason"]
        never = post(server, "/v1/completions", {"model": model_name, "prompt": "b", "n": MAX_WAITING + 1})
        assert error_of(never, 400)["param"] == "n"
    finally:
        for http, response in streams:
            response.close()
            http.close()
    health = wait_until_idle(server, timeout=30)
    assert health["blocks_free"] == health["blocks_total"]
    assert httpx.get(server + "/health").status_code == 200


# ------------------------------------------------------------------------------ 3. stop strings and bodies

def test_3_stop_strings_and_bodies_are_bounded(server, model_name):
    base = {"model": model_name, "prompt": "hi", "max_tokens": 2}
    error = error_of(post(server, "/v1/completions", {**base, "stop": [f"s{i}" for i in range(17)]}), 400)
    assert error["param"] == "stop" and "--max-stop-strings" in error["message"] and "16" in error["message"]
    error = error_of(post(server, "/v1/completions", {**base, "stop": ["x" * 257]}), 400)
    assert error["param"] == "stop" and "--max-stop-length" in error["message"] and "256" in error["message"]
    within = post(server, "/v1/completions", {**base, "stop": [f"{i:03d}" + "y" * 253 for i in range(16)]})
    assert within.status_code == 200, within.text
    # the adversarial case: 100,000 stop strings, a 1.3 MB body, refused before it is parsed
    error = error_of(post(server, "/v1/completions", {**base, "stop": [f"stop{i}" for i in range(100_000)]}), 413)
    assert "--max-body-bytes" in error["message"] and str(MAX_BODY) in error["message"]

    def chunks():                                       # no Content-Length: counted while read
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"z" * 1000
        yield b'"}'
    chunked = httpx.post(server + "/v1/completions", content=chunks(), timeout=30,
                         headers={"content-type": "application/json"})
    assert "--max-body-bytes" in error_of(chunked, 413)["message"]

    def small_chunks():
        yield json.dumps({"model": model_name, "prompt": "chunked", "max_tokens": 2}).encode()
    small = httpx.post(server + "/v1/completions", content=small_chunks(), timeout=30,
                       headers={"content-type": "application/json"})
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(server + "/health").status_code == 200


def test_3_huge_headers_get_431_not_a_reset(server):
    """Headers over the limit: sent at once they reached the routes; sent in pieces uvicorn closed with the rest
    unread, which reset the connection and the client got no answer. Both are a 431 now. A raw socket, because an
    HTTP client may refuse to send such headers itself."""
    import socket

    from minipaged.serve.header_limit import MAX_HEADER_BYTES

    host, port = server.removeprefix("http://").split(":")
    request = (f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\nX-Big: ".encode() + b"a" * 100_000
               + b"\r\n\r\n")
    for piece in (len(request), 4096):                 # one read, then many (h11 refuses while incomplete)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            for start in range(0, len(request), piece):
                sock.sendall(request[start:start + piece])
                time.sleep(0.002 if piece < len(request) else 0)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 "), (piece, answer[:200])
        error = json.loads(body)["error"]
        assert error["code"] == 431 and f"limit of {MAX_HEADER_BYTES} bytes" in error["message"], error
    small = {"X-Small": "a" * 8000}                  # a big cookie still fits
    assert httpx.get(server + "/health", headers=small).status_code == 200


# ------------------------------------------------------------------------------ 4. invalid Unicode

def test_4_lone_surrogates_are_a_400_naming_the_field(server, model_name):
    cases = [("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
             ("/v1/completions", {"prompt": ["a\udfffb"]}, "prompt[0]"),
             ("/v1/completions", {"prompt": "fine", "stop": ["\ud83d"]}, "stop[0]"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]},
              "messages[0].content")]
    for path, body, param in cases:
        error = error_of(raw_post(server, path, {"model": model_name, "max_tokens": 2, **body}), 400)
        assert error["param"] == param and "Unicode" in error["message"], error


# ------------------------------------------------------------------------------ 5. every OpenAI field

# A value for every request field of the openai package's CompletionCreateParams and ChatCompletionCreateParams
# that asks for something (a default would prove nothing). A field that a new openai release adds fails the test
# below until it gets a value here: the server must then honour it or refuse it by name.
SAMPLE_VALUES: dict[str, object] = {
    "model": None, "prompt": None, "messages": None,           # filled in by the test
    "max_tokens": 3, "max_completion_tokens": 3, "n": 2, "seed": 5, "stop": ["\n\n\n"], "stream": True,
    "stream_options": {"include_usage": True}, "temperature": 0.7, "top_p": 0.9, "user": "someone",
    "best_of": 3, "echo": True, "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"42": 5},
    "logprobs": 2, "suffix": " and so on", "top_logprobs": 2, "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "auto",
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto", "parallel_tool_calls": True,
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low", "verbosity": "low",
    "web_search_options": {}, "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
    "safety_identifier": "s", "prompt_cache_key": "k", "prompt_cache_retention": "24h",
    "prompt_cache_options": {}, "moderation": {},
}


# Chat spells log-probabilities differently: a flag, with top_logprobs as the count.
CHAT_SAMPLE_ARGS = {"logprobs": {"logprobs": True}, "top_logprobs": {"logprobs": True, "top_logprobs": 2}}


def openai_fields(params_type: object) -> list[str]:
    """The request fields the installed openai client can send: the keys of its TypedDicts (streaming and not)."""
    members = typing.get_args(params_type) if typing.get_origin(params_type) is typing.Union else (params_type,)
    return sorted({name for member in members for name in typing.get_type_hints(member)})


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_5_every_field_of_the_openai_client_is_honoured_or_refused_by_name(server, client, model_name, kind):
    from openai.types import CompletionCreateParams
    from openai.types.chat import CompletionCreateParams as ChatCompletionCreateParams

    from minipaged.serve.protocol import NO_EFFECT, REFUSED, ChatCompletionRequest, CompletionRequest

    params_type, model_type = ((CompletionCreateParams, CompletionRequest) if kind == "completions"
                               else (ChatCompletionCreateParams, ChatCompletionRequest))
    required = ({"prompt": "hi"} if kind == "completions"
                else {"messages": [{"role": "user", "content": "hi"}]})
    create = client.completions.create if kind == "completions" else client.chat.completions.create
    fields = openai_fields(params_type)
    missing = [f for f in fields if f not in SAMPLE_VALUES]
    assert not missing, f"the openai package has new request fields {missing}: give them a value in SAMPLE_VALUES"
    outcome = {}
    for name in fields:
        if name in ("model", *required):
            continue
        args = {"model": model_name, "max_tokens": 3, **required, name: SAMPLE_VALUES[name]}
        if kind == "chat":                   # chat's logprobs is a flag, and top_logprobs needs it
            args.update(CHAT_SAMPLE_ARGS.get(name, {}))
        if name == "max_completion_tokens":
            del args["max_tokens"]
        try:
            answer = create(**args)
            if name == "stream":
                answer = list(answer)
            outcome[name] = "honoured"
        except openai.BadRequestError as exc:
            assert exc.body["param"] == name and name in exc.body["message"], (name, exc.body)
            outcome[name] = "refused"
        honoured = name in model_type.model_fields or name in NO_EFFECT
        if name == "stream_options":         # honoured, but only beside stream=True (OpenAI's rule)
            continue
        assert outcome[name] == ("honoured" if honoured else "refused"), (name, outcome[name])
        assert honoured or name in REFUSED, f"{name} is refused only as an unknown field: give REFUSED a reason"
    print(kind, outcome)
    assert outcome["n"] == outcome["seed"] == outcome["stop"] == "honoured"
    assert outcome["logit_bias"] == outcome["presence_penalty"] == outcome["logprobs"] == "honoured"
    if kind == "completions":
        assert outcome["best_of"] == outcome["suffix"] == "refused"


def test_5_harmless_values_pass_and_zero_is_not_false(server, model_name):
    base = {"model": model_name, "prompt": "hi", "max_tokens": 2}
    for harmless in ({"logprobs": None}, {"echo": False}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
                     {"logit_bias": {}}, {"best_of": 1}, {"user": "u"}):
        assert post(server, "/v1/completions", {**base, **harmless}).status_code == 200, harmless
    for asking in ({"best_of": 2}, {"suffix": "x"}, {"min_p": 0.1}, {"no_such_field": 1}):
        name = next(iter(asking))
        assert error_of(post(server, "/v1/completions", {**base, **asking}), 400)["param"] == name, asking
    # 0 == False in Python, but logprobs: 0 asks for log-probabilities (of the chosen tokens, no alternatives)
    zero = post(server, "/v1/completions", {**base, "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert zero is not None and len(zero["token_logprobs"]) == len(zero["tokens"]) > 0
    assert post(server, "/v1/completions", {**base, "logprobs": False}).json()["choices"][0]["logprobs"] is None
    chat = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert post(server, "/v1/chat/completions", {**chat, "logprobs": False}).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert post(server, "/v1/chat/completions", {**chat, "tools": []}).status_code == 200
    assert error_of(post(server, "/v1/chat/completions", {**chat, "tools": tools}), 400)["param"] == "tools"


# ------------------------------------------------------------------------------ 6. chat roles

def test_6_chat_roles_are_the_four_openai_roles(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model_name, max_tokens=2,
                                       messages=[{"role": "wizard", "content": "abracadabra"}])
    assert info.value.body["param"] == "messages[0].role" and "'wizard'" in info.value.body["message"]
    for role in ("system", "user", "assistant", "tool"):
        out = client.chat.completions.create(model=model_name, max_tokens=2, messages=[
            {"role": role, "content": "hello", **({"tool_call_id": "call_1"} if role == "tool" else {})}])
        assert out.choices[0].message.role == "assistant"


# ------------------------------------------------------------------------------ 7. error shapes

def test_7_every_error_is_openai_shaped_with_a_meaningful_param(server, model_name):
    broken = httpx.post(server + "/v1/completions", content=b'{"prompt": "a",', timeout=30,
                        headers={"content-type": "application/json"})
    error = error_of(broken, 400)
    assert error["param"] is None and "not valid JSON" in error["message"]
    error = error_of(httpx.get(server + "/v1/no/such/route"), 404)
    assert "/v1/no/such/route" in error["message"] and "POST /v1/completions" in error["message"]
    wrong = httpx.get(server + "/v1/completions")
    assert "use POST" in error_of(wrong, 405)["message"] and wrong.headers["allow"] == "POST"
    error_of(httpx.delete(server + "/health"), 405)
    bad_type = error_of(post(server, "/v1/chat/completions", {"model": model_name,
                                                              "messages": [{"role": "user", "content": 3}]}), 400)
    assert bad_type["param"] == "messages[0].content", bad_type
    assert error_of(post(server, "/v1/completions", {"model": model_name, "prompt": 3}), 400)["param"] == "prompt"
    assert error_of(post(server, "/v1/completions", {"model": model_name}), 400)["param"] == "prompt"


# ------------------------------------------------------------------------------ 8 (server side). heartbeat

def test_8_the_event_stream_sends_heartbeats_while_nothing_happens(server):
    wait_until_idle(server)
    lines, start = [], time.monotonic()
    with httpx.stream("GET", server + "/v1/events", timeout=10) as response:
        for line in response.iter_lines():
            lines.append(line)
            if lines.count(": heartbeat") >= 2:
                break
    took = time.monotonic() - start
    assert lines[0].startswith("data: ") and json.loads(lines[0][6:])["type"] == "engine"
    assert lines.count(": heartbeat") == 2 and took < 10 * HEARTBEAT_S, (took, lines[-4:])


# ------------------------------------------------------------------------------ 10. HEAD and the docs

def test_10_head_answers_on_get_routes_and_docs_need_no_cdn(server):
    for path in ("/health", "/metrics", "/v1/models", "/v1/events", "/openapi.json"):
        response = httpx.head(server + path, timeout=10)
        assert response.status_code == 200 and response.content == b"", path
    docs = httpx.get(server + "/docs")
    assert "cdn" not in docs.text.lower() and docs.status_code == 404 and "error" in docs.json()
    assert httpx.get(server + "/openapi.json").json()["paths"]["/v1/completions"]


def test_10_openapi_is_behind_the_key_when_one_is_set(tiny_engine_factory):
    from fastapi.testclient import TestClient

    from minipaged.serve.api_server import ServerSettings, build_app

    app = build_app(tiny_engine_factory(), ServerSettings("tiny", api_key="sekret"))
    with TestClient(app) as http:
        assert http.get("/openapi.json").status_code == 401
        assert http.head("/v1/models").status_code == 401
        assert http.get("/openapi.json", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert http.head("/health").status_code == 200


def test_health_is_503_while_the_engine_thread_is_stuck(tiny_engine_factory):
    """An engine step that does not return (here: held on purpose) must not leave /health saying ok."""
    from fastapi.testclient import TestClient

    from minipaged.serve.api_server import ServerSettings, build_app

    engine = tiny_engine_factory()
    release = threading.Event()
    real_step = engine.step

    def held_step():
        release.wait(30)
        return real_step()
    engine.step = held_step
    app = build_app(engine, ServerSettings("tiny", engine_stall_s=0.3))
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        sender = threading.Thread(target=http.post, args=("/v1/completions",),
                                  kwargs=dict(json={"prompt": "hi", "max_tokens": 2}))
        sender.start()
        time.sleep(1.0)
        stuck = http.get("/health")
        release.set()
        sender.join(30)
        assert stuck.status_code == 503 and "engine core has been busy" in stuck.json()["reason"], stuck.text
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)


# ------------------------------------------------------------------------------ regression: 200 streams, 50 leave

def test_200_streams_with_50_disconnects_leave_every_block_free(server, model_name):
    wait_until_idle(server)

    async def one(http: httpx.AsyncClient, i: int) -> int:
        body = {"model": model_name, "prompt": f"stream {i}", "max_tokens": 8, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with http.stream("POST", server + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            usage = None
            async for line in response.aiter_lines():
                if i % 4 == 0 and line.startswith("data: "):
                    return -1                            # hang up after the first chunk
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
            return usage["completion_tokens"]

    async def all_of_them() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
            return list(await asyncio.gather(*(one(http, i) for i in range(200))))

    results = asyncio.run(all_of_them())
    assert results.count(-1) == 50 and all(r == 8 for r in results if r != -1)
    health = wait_until_idle(server, timeout=30)
    assert health["blocks_free"] == health["blocks_total"]
