"""``priority`` through the real ``openai`` client (vLLM's extension, sent as ``extra_body``) on a real server.

The server runs one request at a time (``--max-num-seqs 1``) with ``--scheduling-policy priority``. While a
long request runs, four requests of priority 5 queue up; then one of priority -5 arrives. Under FCFS it would
finish last; under priority it is admitted next and finishes before every request that queued before it.
"""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from serve_util import running_server, wait_until_idle


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-priority") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "512", "--max-num-seqs", "1",
                        "--scheduling-policy", "priority", log_path=str(log)) as url:
        yield url


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return openai.OpenAI(base_url=server + "/v1", api_key="none").models.list().data[0].id


async def wait_for(url: str, field: str, count: int, timeout: float = 20.0) -> None:
    """Poll /health until ``field`` (num_requests_running or num_requests_waiting) reaches ``count``."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as http:
        while (await http.get(url + "/health")).json()[field] < count:
            assert time.monotonic() < deadline, f"{field} never reached {count}"
            await asyncio.sleep(0.01)


def test_a_late_high_priority_request_finishes_before_those_queued_earlier(server, model_name):
    client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="none", timeout=120, max_retries=0)
    finished: list[str] = []

    async def complete(name: str, priority: int, max_tokens: int) -> None:
        await client.completions.create(model=model_name, prompt=f"request {name}", max_tokens=max_tokens,
                                        temperature=0, extra_body={"priority": priority, "ignore_eos": True})
        finished.append(name)

    async def scenario() -> None:
        head = asyncio.create_task(complete("head", 0, 600))            # holds the only seat for a while
        await wait_for(server, "num_requests_running", 1)
        lows = [asyncio.create_task(complete(f"low{i}", 5, 8)) for i in range(4)]
        await wait_for(server, "num_requests_waiting", 4)
        assert not head.done(), "the long request finished before the queue formed; make it longer"
        high = asyncio.create_task(complete("high", -5, 8))
        await asyncio.gather(head, high, *lows)

    asyncio.run(scenario())
    assert finished[0] == "head"
    assert finished[1] == "high", f"completion order {finished}: the priority -5 request did not overtake"
    assert sorted(finished[2:]) == [f"low{i}" for i in range(4)]
    wait_until_idle(server)


def test_priority_that_is_not_an_integer_is_a_400(server, model_name):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", timeout=30, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=2, extra_body={"priority": "high"})
    assert "priority" in str(info.value)
