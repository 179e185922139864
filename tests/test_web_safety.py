"""Issue 39: the event stream and the pages stay small and safe whatever one request sends.

An arrival carries a bounded preview of its prompt, once for all its samples; the whole text is fetched on
demand behind the API key; a watcher's backlog counts uncompressed bytes; the pages written for replay keep
their script whatever a prompt contains.
"""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from minipaged import SamplingParams
from minipaged.events import PREVIEW_GAP, PROMPT_PREVIEW_CHARS, EngineView, StepEvent
from serve_util import running_server, wait_until_idle


def test_an_arrival_carries_a_bounded_preview_once_for_all_its_samples(tiny_engine_factory):
    engine = tiny_engine_factory(num_blocks=1024)
    prompt = "start of a long prompt " + "=" * 1800 + "and its own end"    # near the tiny model's context
    engine.add_request(prompt, SamplingParams(n=8, max_tokens=1, temperature=1.0), request_id="big")
    event = engine.step()
    line = event.to_json()
    arrivals = json.dumps(json.loads(line)["arrivals"])
    assert len(arrivals) < 3000, len(arrivals)               # not the 1.8 KB prompt eight times over (15 KB)
    first, *others = event.arrivals
    assert len(first.prompt) <= PROMPT_PREVIEW_CHARS and PREVIEW_GAP in first.prompt
    assert first.prompt.startswith("start of a long prompt") and first.prompt.endswith("and its own end")
    assert all(a.prompt == "" and a.prompt_of == "big.0" for a in others)
    view = EngineView(engine.info)                           # a watcher still sees each sample's prompt
    view.apply(StepEvent.from_dict(json.loads(line)))
    assert {r.prompt for r in view.requests.values()} == {first.prompt} and len(view.requests) == 8


def test_traces_recorded_before_previews_replay(tiny_engine_factory):
    """Old arrivals: a whole prompt (no prompt_of), or the older prompt_preview key."""
    old = {"type": "step", "step": 1, "time_s": 0.1, "duration_s": 0.1, "schedule_s": 0.0, "model_s": 0.1,
           "budget_limit": 32, "budget_used": 0, "max_num_seqs": 8,
           "arrivals": [{"request_id": "a", "prompt_len": 3, "max_tokens": 4, "prompt": "x" * 5000},
                        {"request_id": "b", "prompt_len": 3, "max_tokens": 4, "prompt_preview": "older"}]}
    event = StepEvent.from_dict(old)
    assert [a.prompt_of for a in event.arrivals] == [None, None]
    view = EngineView(tiny_engine_factory().info)
    view.apply(event)
    assert view.requests["a"].prompt == "x" * 5000 and view.requests["b"].prompt == "older"


# ------------------------------------------------------------------------------ a live server, HTTP only

KEY = "class-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("web-safety") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "2048", "--api-key", KEY,
                        "--max-client-samples", "130", "--max-client-prompt-tokens", "150000",
                        "--allowed-hosts", "class.example", "--max-waiting-requests", "1000",
                        log_path=str(log)) as url:
        yield url


def as_client(address: str) -> dict[str, str]:
    """Headers of a request from ``address``: the server trusts X-Forwarded-For from 127.0.0.1 only (uvicorn's
    default for a proxy on the same machine), which lets one test speak as several clients."""
    return {**AUTH, "X-Forwarded-For": address}


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_only_the_servers_own_host_names_are_answered(server):
    port = server.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"class.example:{port}", f"[::1]:{port}"):
        assert httpx.get(server + "/health", headers={"Host": host}).status_code == 200, host
    refused = httpx.get(server + "/v1/events", headers={**AUTH, "Host": f"evil.example:{port}"})
    error = openai_error(refused, 400)
    assert "'evil.example'" in error["message"] and "--allowed-hosts evil.example" in error["message"]


def test_which_names_a_bind_address_answers_to():
    from minipaged.serve.host_check import allowed_hosts, host_name, machine_names

    assert host_name("Example.COM:8000") == "example.com" and host_name("[::1]:80") == "::1"
    assert host_name("::1") == "::1" and host_name("10.0.0.5") == "10.0.0.5"
    local = allowed_hosts("127.0.0.1")                   # loopback-bound: loopback names only
    assert "localhost" in local and not (machine_names() - {"127.0.0.1", "::1", "localhost"}) & local
    room = allowed_hosts("0.0.0.0", ["Class.Example"])
    assert {"localhost", "class.example", socket.gethostname().lower()} <= room
    assert "10.1.2.3" in allowed_hosts("10.1.2.3")
    assert "*" in allowed_hosts("127.0.0.1", ["*"])


def test_the_page_and_its_files_may_not_be_framed_or_load_anything_foreign(server):
    for path in ("/", "/web/app.mjs", "/web/style.css"):
        headers = httpx.get(server + path).headers
        csp = headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'self'" in csp, path
        assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff", path


def test_a_body_that_is_not_json_is_told_to_send_json(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2})
    for media in ("text/plain", "application/x-www-form-urlencoded"):
        refused = httpx.post(server + "/v1/completions", content=body, headers={**AUTH, "Content-Type": media})
        assert "send application/json" in openai_error(refused, 400)["message"], media
    ok = httpx.post(server + "/v1/completions", content=body, timeout=60,
                    headers={**AUTH, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_the_whole_prompt_is_there_on_demand_behind_the_key(server):
    prompt = "the start " + "=" * 1500 + " the end"
    body = {"prompt": prompt, "n": 2, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as response:
        lines = response.iter_lines()
        request_id = next(json.loads(line[6:])["id"] for line in lines if line.startswith("data: {"))
        whole = httpx.get(f"{server}/v1/events/prompts/{request_id}.1", headers=AUTH, timeout=10)
        assert httpx.get(f"{server}/v1/events/prompts/{request_id}", timeout=10).status_code == 401
    assert whole.status_code == 200 and whole.json()["prompt"] == prompt
    gone = httpx.get(f"{server}/v1/events/prompts/{request_id}", headers=AUTH, timeout=10)
    assert "runs or waits" in openai_error(gone, 404)["message"]
    wait_until_idle(server)


def test_one_client_over_its_share_gets_429_and_the_others_are_served(server):
    held = {"prompt": [7] * 1000, "n": 100, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=held, headers=as_client("10.0.0.1"),
                      timeout=60) as hog:
        lines = hog.iter_lines()              # kept: an iterator dropped half-way closes the response
        next(line for line in lines if line.startswith("data: {"))                  # in the engine
        more = {"prompt": "hi", "n": 40, "max_tokens": 2}
        refused = httpx.post(server + "/v1/completions", json=more, headers=as_client("10.0.0.1"), timeout=60)
        error = openai_error(refused, 429)
        assert error["type"] == "RateLimitError" and "--max-client-samples" in error["message"]
        assert refused.headers["retry-after"] == "1"
        tokens = {"prompt": [8] * 1900, "n": 28, "max_tokens": 1}      # 100 x 1000 + 28 x 1900 > 150,000
        refused = httpx.post(server + "/v1/completions", json=tokens, headers=as_client("10.0.0.1"), timeout=60)
        assert "--max-client-prompt-tokens" in openai_error(refused, 429)["message"]
        other = httpx.post(server + "/v1/completions", json=more, headers=as_client("10.0.0.2"), timeout=60)
        assert other.status_code == 200 and len(other.json()["choices"]) == 40
    never = {"prompt": [9] * 1600, "n": 100, "max_tokens": 1}            # 160,000 tokens: never fits
    assert "--max-client-prompt-tokens 150000" in openai_error(
        httpx.post(server + "/v1/completions", json=never, headers=as_client("10.0.0.3"), timeout=60), 400)["message"]
    health = wait_until_idle(server, timeout=30)
    assert health["blocks_free"] == health["blocks_total"]
    again = httpx.post(server + "/v1/completions", json=more, headers=as_client("10.0.0.1"), timeout=60)
    assert again.status_code == 200                                  # the hog's share came back when it left
