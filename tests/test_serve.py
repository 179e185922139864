"""``minipaged serve`` against the real ``openai`` client (sync and async), on a real server subprocess.

One server (tiny random Llama, 127.0.0.1, a free port) serves the whole module. Counters on /metrics are
compared as differences around each test, since the tests share the server.
"""
from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_util import openai_client, running_server, wait_until_idle

MAX_NUM_SEQS = 8
MAX_WAITING = 16


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "512", "--max-num-seqs", str(MAX_NUM_SEQS),
                        "--max-waiting-requests", str(MAX_WAITING), log_path=str(log)) as url:
        yield url


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return openai.OpenAI(base_url=server + "/v1", api_key="none").models.list().data[0].id


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def metric_samples(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics, parsed by prometheus_client's own parser: (name, labels) -> value."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _labels), v in samples.items() if n == name)


def raw_sse(url: str, path: str, body: dict) -> list[str]:
    """The ``data:`` payloads of a streamed response, exactly as sent."""
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------------------------ completions and chat

def test_models_lists_the_served_model(client, tiny_model):
    assert [m.id for m in client.models.list().data] == [tiny_model]


def test_completion_stream_joins_to_the_non_streamed_text_with_exact_usage(client, model_name, tokenizer):
    prompt = "The paged KV cache keeps"
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(tokenizer(prompt).input_ids)
    assert full.usage.completion_tokens == 12 and full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == choice.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_token_id_prompt_is_the_same_request_as_its_text(client, model_name, tokenizer):
    prompt = "Blocks of sixteen tokens"
    by_text = client.completions.create(model=model_name, prompt=prompt, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model_name, prompt=tokenizer(prompt).input_ids, max_tokens=6,
                                       temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.model_dump() == by_text.usage.model_dump()


def test_raw_stream_is_shaped_like_openai(server, model_name):
    """finish_reason only in a choice's last chunk (per choice with n=2), the usage chunk with empty choices,
    then [DONE]; nothing after it."""
    for path, extra in (("/v1/completions", {"prompt": "Continuous batching"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]})):
        events = raw_sse(server, path, {"model": model_name, "max_tokens": 7, "n": 2, "temperature": 0.8,
                                        "seed": 3, "ignore_eos": True, "stream": True,
                                        "stream_options": {"include_usage": True}, **extra})
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage_chunk = chunks[-1]
        assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 14
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks[:-1] if c["choices"][0]["index"] == index]
            reasons = [c["finish_reason"] for c in mine]
            # (a choice may come in fewer chunks than tokens: a reader behind the engine gets steps merged)
            assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}, (path, reasons)
        assert all(c["usage"] is None for c in chunks[:-1])


def test_chat_sync_and_async_stream_and_not_agree(client, server, model_name, tokenizer):
    messages = [{"role": "user", "content": "What does a block table map?"}]
    full = client.chat.completions.create(model=model_name, messages=messages, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"]
    assert full.usage.prompt_tokens == len(expected_prompt) and full.usage.completion_tokens == 10
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"

    async def streamed() -> tuple[str, list]:
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=60, max_retries=0)
        stream = await aclient.chat.completions.create(model=model_name, messages=messages, max_tokens=10,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        await aclient.close()
        return "".join(c.choices[0].delta.content or "" for c in chunks), chunks

    text, chunks = asyncio.run(streamed())
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_n_two_gives_two_choices_and_counts_both(client, model_name):
    out = client.completions.create(model=model_name, prompt="Two samples", max_tokens=5, n=2, temperature=1.0,
                                    seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 10


def test_stop_string_cuts_the_text_streamed_or_not(client, model_name):
    prompt = "Prefix caching shares"
    free = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free[6:8]
    assert len(stop) == 2
    expected = free[:free.index(stop)]
    cut = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=24, temperature=0,
                                            stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeds_reproduce_and_differ(client, model_name):
    def sample(seed: int) -> str:
        return client.completions.create(model=model_name, prompt="Sampling with a seed", max_tokens=16,
                                         temperature=2.0, seed=seed, extra_body={"ignore_eos": True}).choices[0].text
    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


# ------------------------------------------------------------------------------------ errors

def test_bad_requests_get_error_json_while_a_long_stream_is_unharmed(client, server, model_name):
    # (2000 of the 2048-token context: a tiny-model decode step takes well under a millisecond now, and 1000
    # tokens could finish before the bad requests below were all answered)
    prompt, n_long = "A long request keeps streaming", 2000
    reference = client.completions.create(model=model_name, prompt=prompt, max_tokens=n_long, temperature=0,
                                          extra_body={"ignore_eos": True})
    got: dict = {}
    streaming = threading.Event()

    def long_stream() -> None:
        chunks = []
        for chunk in client.completions.create(model=model_name, prompt=prompt, max_tokens=n_long, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            chunks.append(chunk)
            streaming.set()
        got["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
        got["usage"] = chunks[-1].usage

    worker = threading.Thread(target=long_stream)
    worker.start()
    assert streaming.wait(60), "the long stream never started"
    base = {"model": model_name, "prompt": "hi", "max_tokens": 4}
    bad = [  # (body changes, status, words the message must contain)
        ({"temperature": -1}, 400, "temperature"),
        ({"top_p": 7}, 400, "top_p"),
        ({"n": 0}, 400, "n must be"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": 5000}, 400, "maximum context length is 2048 tokens. However, you requested 5002 tokens"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": [999999]}, 400, "outside the vocabulary"),
        ({"prompt": ["a", ""]}, 400, "empty"),
        ({"prompt": 3}, 400, "prompt"),
        ({"logprobs": -1}, 400, "logprobs"),
        ({"stop": [""]}, 400, "stop"),
        ({"model": "gpt-9"}, 404, "does not exist"),
    ]
    async def send_all() -> list[httpx.Response]:      # at once: all of them land while the stream runs
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*[http.post(server + "/v1/completions", json={**base, **change})
                                          for change, _status, _words in bad])
    responses = asyncio.run(send_all())
    alive_after_bad_ones = worker.is_alive()
    for (change, status, words), response in zip(bad, responses):
        assert response.status_code == status, (change, response.text)
        error = response.json()["error"]
        assert words in error["message"], (change, error)
        assert error["code"] == status and error["type"].endswith("Error")
    broken = httpx.post(server + "/v1/completions", content=b"{not json", timeout=30,
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "error" in broken.json()
    no_messages = httpx.post(server + "/v1/chat/completions", json={"model": model_name, "messages": []}, timeout=30)
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    assert alive_after_bad_ones, "the long request finished before the bad ones were answered; make it longer"
    worker.join(60)
    assert got["text"] == reference.choices[0].text
    assert got["usage"].completion_tokens == n_long


def test_over_the_waiting_limit_is_503_with_retry_after(server, model_name):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": model_name, "prompt": "busy", "max_tokens": 40, "ignore_eos": True}
            return await asyncio.gather(*[http.post(server + "/v1/completions", json=body) for _ in range(60)])

    responses = asyncio.run(burst())
    busy = [r for r in responses if r.status_code == 503]
    assert busy and all(r.status_code in (200, 503) for r in responses)
    assert len(responses) - len(busy) >= MAX_NUM_SEQS
    assert busy[0].headers["retry-after"] == "1" and "--max-waiting-requests" in busy[0].json()["error"]["message"]
    health = wait_until_idle(server)
    assert health["blocks_free"] == health["blocks_total"]


# ------------------------------------------------------------------------------------ load and metrics

def test_200_concurrent_requests_complete_free_every_block_and_match_metrics(server, model_name):
    before = metric_samples(server)
    rng = random.Random(0)
    jobs = [(f"request {i}: " + "x" * rng.randint(0, 30), rng.randint(1, 8)) for i in range(200)]

    async def run_all() -> list:
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)
        limit = asyncio.Semaphore(MAX_NUM_SEQS)

        async def one(prompt: str, max_tokens: int):
            async with limit:
                return await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens,
                                                        temperature=0.7, extra_body={"ignore_eos": True})
        try:
            return await asyncio.gather(*[one(p, m) for p, m in jobs])
        finally:
            await aclient.close()

    outs = asyncio.run(run_all())
    assert [o.usage.completion_tokens for o in outs] == [m for _p, m in jobs]
    health = wait_until_idle(server)
    assert health["blocks_free"] == health["blocks_total"]
    after = metric_samples(server)

    def delta(name: str) -> float:
        return total(after, name) - total(before, name)
    assert delta("minipaged:request_success_total") == 200
    assert delta("minipaged:generation_tokens_total") == sum(m for _p, m in jobs)
    assert delta("minipaged:request_generation_tokens_count") == 200
    assert delta("minipaged:request_prompt_tokens_sum") == sum(o.usage.prompt_tokens for o in outs)
    assert after[("minipaged:kv_cache_usage_perc", ())] == 0.0
    assert any("cache_hit" in name for name, _labels in after)     # the guide's `grep cache_hit`


def test_every_metric_vllms_grafana_dashboard_queries_is_served_with_its_model_name_label(server, model_name):
    """vLLM's own dashboard, unchanged, finds each of its series: the name, and the model_name it filters on."""
    listed = Path(__file__).parent / "data" / "vllm_grafana_metrics.txt"
    wanted = [line for line in listed.read_text().splitlines() if line and not line.startswith("#")]
    httpx.post(server + "/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 2}, timeout=30)
    served = {(name, dict(labels).get("model_name")) for name, labels in metric_samples(server)}
    missing = [name for name in wanted if (name, model_name) not in served]
    assert len(wanted) >= 20 and not missing, f"not on /metrics with model_name={model_name!r}: {missing}"


def test_a_client_that_disconnects_mid_stream_is_aborted_and_frees_its_blocks(server, model_name):
    wait_until_idle(server)
    before = metric_samples(server)
    body = {"model": model_name, "prompt": "I will hang up soon", "max_tokens": 1500, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(8))]
        assert response.status_code == 200 and any(line.startswith("data: ") for line in received)
        busy = httpx.get(server + "/health").json()
        assert busy["num_requests_running"] == 1 and busy["blocks_free"] < busy["blocks_total"]
        closed_at_step = busy["steps"]
    start = time.monotonic()
    health = wait_until_idle(server, timeout=5.0)
    assert health["blocks_free"] == health["blocks_total"]
    after = metric_samples(server)
    aborted = ("minipaged:request_success_total", (("finished_reason", "abort"),))
    assert after.get(aborted, 0) - before.get(aborted, 0) == 1
    generated = total(after, "minipaged:generation_tokens_total") - total(before, "minipaged:generation_tokens_total")
    assert generated < 1500
    # Bounded in time, not in steps: a tiny-model step takes well under a millisecond on a quiet machine, so the
    # ~0.1 s the server may take to see the closed connection (measured here: 0.04 to 0.11 s, 6 to 181 steps
    # after the last health check before the close) is many steps, and more the faster the machine.
    freed_after_s = time.monotonic() - start
    steps_after = health["steps"] - closed_at_step
    assert freed_after_s < 1.0, f"the request ran {freed_after_s:.2f} s ({steps_after} steps) after its client hung up"
    assert steps_after < 1000                            # far below the 1500 tokens it asked for
    print(f"freed {freed_after_s:.3f} s after the close, {steps_after} steps after the last health check before it")


def test_a_non_streaming_client_that_gives_up_is_aborted_too(server, model_name):
    wait_until_idle(server)
    before = metric_samples(server)
    # (2000 tokens, the context's most: a tiny-model step takes a fraction of a millisecond, so the client gives
    # up after 0.15 s, well before they are done)
    body = {"model": model_name, "prompt": "I will not wait", "max_tokens": 2000, "ignore_eos": True}
    started = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.15))
    print(f"gave up after {time.monotonic() - started:.3f} s")
    health = wait_until_idle(server, timeout=5.0)
    assert health["blocks_free"] == health["blocks_total"]
    aborted = ("minipaged:request_success_total", (("finished_reason", "abort"),))
    assert metric_samples(server).get(aborted, 0) - before.get(aborted, 0) == 1


# ------------------------------------------------------------------------------------ the event stream

def read_events(url: str, until_step: list, into: list, ready: threading.Event) -> None:
    """Collect /v1/events records until one with step >= until_step[0] arrives (until_step[0] is set later: the
    watchers read until a step chosen once both are in)."""
    with httpx.stream("GET", url + "/v1/events", timeout=30) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            record = json.loads(line[len("data: "):])
            into.append(record)
            if record["type"] == "step":
                ready.set()
            if (record["type"] == "step" and until_step[0] is not None and record["step"] >= until_step[0]
                    and len(into) > 2):
                return


def test_a_late_watcher_sees_the_same_block_map_as_an_early_one(client, server, model_name):
    from minipaged.event_view import EngineView
    from minipaged.events import EngineInfo, StepEvent

    wait_until_idle(server)
    start_step = httpx.get(server + "/health").json()["steps"]
    # Both watchers read to the same step: one chosen once the late watcher has its snapshot, while the three
    # 800-token requests still run (>= 800 steps), however fast the steps or slow the machine.
    target: list = [None]
    early, late = [], []
    early_ready, late_ready = threading.Event(), threading.Event()
    watcher = threading.Thread(target=read_events, args=(server, target, early, early_ready))
    watcher.start()
    requests = [threading.Thread(target=client.completions.create,
                                 kwargs=dict(model=model_name, prompt=f"watch me {i} " * (i + 1), max_tokens=800,
                                             temperature=0, extra_body={"ignore_eos": True})) for i in range(3)]
    for r in requests:
        r.start()
    assert early_ready.wait(20)
    deadline = time.monotonic() + 20
    while httpx.get(server + "/health").json()["steps"] < start_step + 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    late_watcher = threading.Thread(target=read_events, args=(server, target, late, late_ready))
    late_watcher.start()
    assert late_ready.wait(20)
    target[0] = max(r["step"] for r in list(late) if r["type"] == "step") + 30
    for t in (*requests, watcher, late_watcher):
        t.join(60)
    assert late[0]["type"] == "engine" and late[1]["type"] == "step"
    assert start_step < late[1]["step"] < target[0] and late[1]["arrivals"], \
        "the late watcher joined while requests ran"
    target = target[0]

    def fold(records: list) -> EngineView:
        view = EngineView(EngineInfo(**{k: v for k, v in records[0].items() if k != "type"}))
        for record in records[1:]:
            event = StepEvent.from_dict(record)
            if event.step <= target:
                view.apply(event)
        return view
    early_view, late_view = fold(early), fold(late)
    assert early_view.step == late_view.step == target
    assert early_view.block_owners == late_view.block_owners
    assert early_view.block_cached == late_view.block_cached


# ------------------------------------------------------------------------------------ in-process checks

def test_api_key_guards_v1_but_not_health_or_metrics(tiny_engine_factory):
    from fastapi.testclient import TestClient

    from minipaged.serve.api_server import ServerSettings, build_app

    app = build_app(tiny_engine_factory(), ServerSettings("tiny", api_key="sekret"))
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with TestClient(app) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = http.post("/v1/completions", json=body, headers=headers)
            assert refused.status_code == 401 and "--api-key" in refused.json()["error"]["message"]
        assert http.get("/v1/models").status_code == 401
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        ok = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_no_middleware_copies_each_streamed_chunk(tiny_engine_factory):
    """The wrappers in front of the routes are plain ASGI (http_guards.py): Starlette's BaseHTTPMiddleware, which
    ``@app.middleware("http")`` makes, passes every chunk of a stream through a memory stream and a task of its
    own, and with one token per chunk that was most of the server's work per token."""
    from starlette.middleware.base import BaseHTTPMiddleware

    from minipaged.serve.api_server import ServerSettings, build_app

    for settings in (ServerSettings("tiny"), ServerSettings("tiny", api_key="sekret")):
        app = build_app(tiny_engine_factory(), settings)
        assert app.user_middleware and not any(issubclass(m.cls, BaseHTTPMiddleware) for m in app.user_middleware)


def test_serve_binds_localhost_unless_told():
    from minipaged.cli import make_parser

    assert make_parser().parse_args(["serve"]).host == "127.0.0.1"
    assert make_parser().parse_args(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
