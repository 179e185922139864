"""`minipaged bench serve` against a real `minipaged serve` (tiny model, 127.0.0.1, a free port)."""
from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path

import httpx
import pytest

from minipaged.bench.requests import LengthRange, make_requests
from minipaged.bench.requests import BenchRequest
from minipaged.bench.serve import RequestResult, request_body, summarize
from minipaged.bench.servers import metric_totals as counters
from minipaged.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from serve_util import free_port, running_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    with running_server(tiny_model, "--block-size", "4", "--num-blocks", "512", "--max-num-seqs", "4",
                        log_path=str(log)) as url:
        yield url


def test_bench_serve_agrees_with_the_servers_metrics(server, tiny_model, tmp_path):
    model = httpx.get(server + "/v1/models", timeout=5).json()["data"][0]["id"]
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    out, picture = tmp_path / "s.json", tmp_path / "s.png"
    before = counters(server)
    assert main(["bench", "serve", "--base-url", server, "--model", model, "--num-prompts", "8",
                 "--input-len", "6:20", "--output-len", "5", "--max-concurrency", "3", "--request-rate", "50",
                 "--vocab-size", str(vocab), "--dataset-seed", "2", "--goodput", "e2el:60000",
                 "--output-json", str(out), "--plot", str(picture)]) == 0
    after = counters(server)
    record = json.loads(out.read_text())
    sent_in = sum(len(r.prompt_token_ids) for r in make_requests("random", 8, LengthRange(6, 20), LengthRange(5, 5),
                                                                 vocab_size=vocab, seed=2))
    assert (record["completed"], record["failed"]) == (8, 0)
    assert (record["input_tokens"], record["output_tokens"]) == (sent_in, 40)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    assert delta["minipaged:request_success_total"] == 8
    assert delta["minipaged:generation_tokens_total"] == 40
    assert delta["minipaged:request_prompt_tokens_sum"] == sent_in
    for r in record["requests"]:
        assert 0 < r["ttft_s"] <= r["e2el_s"]
        assert len(r["itl_s"]) <= r["output_tokens"] - 1
    assert record["good_requests"] == 8                  # a minute per request: everyone meets it
    assert record["ttft"]["median_ms"] <= record["ttft"]["p99_ms"]
    data = picture.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_goodput_counts_only_requests_meeting_every_slo():
    fast = RequestResult(10, output_tokens=5, ttft_s=0.1, e2el_s=0.5)        # tpot 100 ms
    slow_start = RequestResult(10, output_tokens=5, ttft_s=0.9, e2el_s=1.3)  # tpot 100 ms
    slow_tokens = RequestResult(10, output_tokens=5, ttft_s=0.1, e2el_s=2.1)  # tpot 500 ms
    failed = RequestResult(10, error="HTTP 500")
    results = [fast, slow_start, slow_tokens, failed]
    summary = summarize(2.0, results, {"ttft": 200, "tpot": 150})
    assert summary["good_requests"] == 1 and summary["request_goodput"] == 0.5
    assert summarize(2.0, results, {"ttft": 1000})["good_requests"] == 3
    assert (summary["completed"], summary["failed"], summary["output_tokens"]) == (3, 1, 15)


@pytest.mark.parametrize("argv, message", [
    (["--goodput", "latency:5"], "METRIC:MILLISECONDS"),
    (["--goodput", "ttft:-1"], "METRIC:MILLISECONDS"),
    (["--request-rate", "0"], "above 0"),
    (["--max-concurrency", "0"], "at least 1"),
    (["--request-rate", "1", "nope"], "requests per second"),
    (["--extra-body", "[1, 2]"], "JSON object"),
    (["--extra-body", "{oops"], "not JSON"),
])
def test_bad_serve_flags_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_an_unreachable_server_fails_every_request_and_says_why(capsys):
    url = f"http://127.0.0.1:{free_port()}"                  # nothing listens there
    assert main(["bench", "serve", "--base-url", url, "--model", "m", "--num-prompts", "2", "--timeout", "5"]) == 1
    printed = capsys.readouterr().out
    assert "completed 0 requests (2 failed)" in printed and "ConnectError" in printed


def test_a_prompts_file_is_sent_as_text_and_counted_by_the_servers_tokenizer(server, tiny_model, tmp_path):
    from transformers import AutoTokenizer
    model = httpx.get(server + "/v1/models", timeout=5).json()["data"][0]["id"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "why is the sky blue?"}\n{"prompt": "hello"}\n')
    out = tmp_path / "s.json"
    before = counters(server)
    assert main(["bench", "serve", "--base-url", server, "--model", model, "--dataset", str(prompts),
                 "--num-prompts", "3", "--output-len", "4", "--output-json", str(out)]) == 0
    delta = {name: value - before.get(name, 0.0) for name, value in counters(server).items()}
    record = json.loads(out.read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    server_counted = sum(len(tokenizer.encode(t)) for t in ("why is the sky blue?", "hello", "why is the sky blue?"))
    assert record["input_tokens"] == delta["minipaged:request_prompt_tokens_sum"] == server_counted
    assert record["output_tokens"] == delta["minipaged:generation_tokens_total"] == 12


def test_chat_endpoint_streams_deltas_and_counts_exactly(server, tmp_path):
    model = httpx.get(server + "/v1/models", timeout=5).json()["data"][0]["id"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "tell me a story"}\n')
    out = tmp_path / "c.json"
    before = counters(server)
    assert main(["bench", "serve", "--base-url", server, "--model", model, "--endpoint", "chat",
                 "--dataset", str(prompts), "--num-prompts", "2", "--output-len", "6", "--output-json", str(out)]) == 0
    delta = {name: value - before.get(name, 0.0) for name, value in counters(server).items()}
    record = json.loads(out.read_text())
    assert (record["completed"], record["output_tokens"]) == (2, 12)
    assert record["input_tokens"] == delta["minipaged:request_prompt_tokens_sum"]
    assert all(r["ttft_s"] > 0 for r in record["requests"])     # text arrived in delta.content and was timed


def test_chat_endpoint_needs_text_prompts(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--endpoint", "chat"]) == 2
    assert "--endpoint chat sends text" in capsys.readouterr().err


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_a_rate_sweep_gives_each_rate_its_own_requests_and_agrees_with_the_servers_metrics(server, tiny_model,
                                                                                          tmp_path, capsys):
    model = httpx.get(server + "/v1/models", timeout=5).json()["data"][0]["id"]
    vocab = json.loads((Path(tiny_model) / "config.json").read_text())["vocab_size"]
    out, picture = tmp_path / "sweep.json", tmp_path / "sweep.png"
    before = counters(server)
    assert main(["bench", "serve", "--base-url", server, "--model", model, "--num-prompts", "4",
                 "--input-len", "6:20", "--output-len", "3", "--request-rate", "20", "inf", "--vocab-size", str(vocab),
                 "--dataset-seed", "5", "--output-json", str(out), "--plot", str(picture)]) == 0
    delta = {name: value - before.get(name, 0.0) for name, value in counters(server).items()}
    record = json.loads(out.read_text())
    expected = make_requests("random", 8, LengthRange(6, 20), LengthRange(3, 3), vocab_size=vocab, seed=5)
    assert record["bench"] == "serve-sweep"
    assert [r["request_rate"] for r in record["sweep"]] == record["workload"]["request_rates"] == ["20.0", "inf"]
    for i, run in enumerate(record["sweep"]):          # rate i sent requests 4i..4i+3 of one dataset, in order
        assert (run["completed"], run["failed"], run["output_tokens"]) == (4, 0, 12)
        assert [r["input_tokens"] for r in run["requests"]] == [len(e.prompt_token_ids) for e in expected[4 * i:4 * i + 4]]
        assert run["ttft"]["median_ms"] > 0 and run["tpot"]["median_ms"] > 0
    assert delta["minipaged:request_success_total"] == 8
    assert delta["minipaged:generation_tokens_total"] == 24
    assert delta["minipaged:request_prompt_tokens_sum"] == sum(len(e.prompt_token_ids) for e in expected)
    assert "--- request rate 20/s" in capsys.readouterr().out
    assert png_size(picture.read_bytes()) == (1500, 400)          # three panels of 5 x 4 inches at 100 dpi

    compared = tmp_path / "compare.png"                 # bench compare draws sweeps as lines against the rate
    assert main(["bench", "compare", str(out), str(out), "--plot", str(compared)]) == 0
    assert "rate inf: median TTFT ms" in capsys.readouterr().out
    assert png_size(compared.read_bytes()) == (1500, 400)


def test_no_ignore_eos_and_extra_body_shape_the_request_for_servers_with_their_own_fields():
    request = BenchRequest([5, 6, 7], 4)
    assert request_body("completions", "m", request)["ignore_eos"] is True
    body = request_body("completions", "m", request, ignore_eos=False,
                        extra={"generation_config": '{"eos_token_id": -1}', "temperature": 0.5})
    assert "ignore_eos" not in body
    assert body["generation_config"] == '{"eos_token_id": -1}' and body["temperature"] == 0.5   # extra wins
    assert (body["prompt"], body["max_tokens"], body["stream"]) == ([5, 6, 7], 4, True)


CB_NUM_BLOCKS = 64           # 1024 tokens: two short prompts and their 5 tokens each fit many times over


def test_bench_serve_measures_transformers_serve_with_its_own_way_of_ignoring_eos(tiny_model, tmp_path):
    """The peer comparison's path: transformers serve refuses ignore_eos (422), and with --no-ignore-eos and a
    per-request generation_config that disables EOS it makes exactly the tokens asked for."""
    from transformers.utils.import_utils import is_serve_available
    if not is_serve_available():
        pytest.skip("transformers serve needs fastapi, uvicorn and openai (the [test] extra has them)")
    from minipaged.bench.servers import running, transformers_serve_command
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "why is the sky blue?"}\n{"prompt": "hello"}\n')
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    common = ["--model", tiny_model, "--dataset", str(prompts), "--num-prompts", "2", "--output-len", "5",
              "--timeout", "120"]
    # A small KV cache. Left to itself, transformers' continuous batching sizes its cache on the CPU to 60% of the
    # memory it finds free (generation/continuous_batching: resolve_max_memory_percent), allocated at the first
    # request, after the stream's 200 headers went out: here the first token then took 39 s instead of 0.5 s, and
    # on a machine busy with other work a server that takes most of the RAM can be killed mid-stream, which the
    # client sees as "RemoteProtocolError: peer closed connection without sending complete message body".
    flags = ["--continuous-batching", "--cb-num-blocks", str(CB_NUM_BLOCKS), "--cb-block-size", "16"]
    with running(transformers_serve_command(tiny_model, port, flags), port, env=env,
                 what="transformers serve", log_path=str(tmp_path / "transformers.log")) as url:
        refused, out = tmp_path / "refused.json", tmp_path / "peer.json"
        assert main(["bench", "serve", "--base-url", url, *common, "--output-json", str(refused)]) == 1
        assert all("HTTP 422" in r["error"] for r in json.loads(refused.read_text())["requests"])
        assert main(["bench", "serve", "--base-url", url, *common, "--no-ignore-eos", "--extra-body",
                     '{"generation_config": "{\\"eos_token_id\\": -1}"}', "--output-json", str(out)]) == 0
    record = json.loads(out.read_text())
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert (record["completed"], record["output_tokens"]) == (2, 10)
    assert record["input_tokens"] == sum(len(tokenizer.encode(t)) for t in ("why is the sky blue?", "hello"))
    # the server kept to the cache it was given (its memory is what made this test fail on a loaded machine)
    assert record["ttft"]["p99_ms"] < 10_000, "transformers serve took its time: did it size its own KV cache?"


def test_the_one_request_bench_streams_one_greedy_answer_of_exactly_its_length(server):
    """bench/one_request.py's serve path: max_tokens tokens (ignore_eos), the same greedy text each time, and a
    first token before the last (its speed divides the count it asked for, so the count must be exact)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from minipaged.bench.one_request import stream_one
    model = httpx.get(server + "/v1/models", timeout=5).json()["data"][0]["id"]
    before = counters(server)
    first, second = stream_one(server, 12, model=model), stream_one(server, 12, model=model)
    assert counters(server)["minipaged:generation_tokens_total"] - before.get("minipaged:generation_tokens_total",
                                                                              0.0) == 24
    assert first["text"] == second["text"] and first["num_chunks"] >= 1
    assert 0 < first["ttft_s"] and first["tok_s"] > 0
