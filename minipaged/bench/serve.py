"""``minipaged bench serve``: latency and throughput of an OpenAI-compatible server under load, as ``vllm bench serve``.

Requests arrive as a Poisson process (``--request-rate`` per second; ``inf`` sends them all at once), at most
``--max-concurrency`` in flight, each a streaming ``/v1/completions`` call with token-id prompts, a fixed
``max_tokens`` and ``ignore_eos`` (so token counts are exact; vLLM and ``minipaged serve`` both accept these).
Several rates (``--request-rate 1 2 4``) make a sweep, as vLLM's benchmark scripts run one: each rate gets
its own ``--num-prompts`` requests (the next slice of one dataset, so no rate finds another rate's prompts in
the prefix cache), one after another, and the result has one entry per rate.
A server that refuses fields it does not know (``transformers serve`` answers 422 to ``ignore_eos``) gets
``--no-ignore-eos`` and, through ``--extra-body``, its own way of ignoring EOS.
A prompts file (``--dataset FILE.jsonl``) is sent as text, and ``--endpoint chat`` sends each prompt as one
user message to ``/v1/chat/completions``. Token counts come from the stream's ``usage``.
From each stream's chunk arrival times:

* TTFT: send until the first chunk with text; ITL: the gaps between text chunks;
* TPOT: (end-to-end - TTFT) / (output tokens - 1), the mean time per token after the first;
* end-to-end latency (E2EL): send until the stream ends.

Goodput counts only requests that meet every SLO given with ``--goodput ttft:MS tpot:MS e2el:MS``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from . import report
from .requests import DATASETS, BenchError, BenchRequest, describe, make_requests, parse_length, positive_int

SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestResult:
    input_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: Optional[str] = None

    @property
    def tpot_s(self) -> float:
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give requests per second, or inf for all at once") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the request rate must be above 0 (or inf)")
    return rate


def parse_json_object(text: str) -> dict[str, Any]:
    """argparse type for ``--extra-body``: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({exc.msg}); give an object, e.g. "
                                         f"'{{\"top_k\": 1}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: give a JSON object ({{...}}), merged into every request")
    return value


def parse_slo(text: str) -> tuple[str, float]:
    """argparse type for one ``--goodput`` item: ``ttft:500`` (milliseconds)."""
    name, _, ms = text.partition(":")
    try:
        value = float(ms)
    except ValueError:
        value = -1.0
    if name not in SLO_METRICS or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give METRIC:MILLISECONDS with METRIC one of "
                                         f"{', '.join(SLO_METRICS)}, e.g. ttft:500 tpot:50")
    return name, value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .throughput import add_workload_arguments
    add_workload_arguments(parser, input_len="40:400", output_len="16:128")
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="requests to send")
    parser.add_argument("--request-rate", type=parse_rate, nargs="+", default=[float("inf")], metavar="RATE",
                        help="requests per second, Poisson arrivals; inf sends all at once; several rates run "
                             "one after another (a sweep), each with its own --num-prompts requests")
    parser.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight")
    parser.add_argument("--goodput", type=parse_slo, nargs="+", default=[], metavar="METRIC:MS",
                        help="SLOs a request must meet to count toward goodput: ttft, tpot, e2el in ms")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                        help="/v1/completions, or /v1/chat/completions (one user message; needs a prompts file)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos so every request makes exactly its output length (vLLM's and "
                             "minipaged's extension; --no-ignore-eos for servers that refuse it)")
    parser.add_argument("--extra-body", type=parse_json_object, default={}, metavar="JSON",
                        help="a JSON object merged into every request body (a server's own fields)")
    parser.add_argument("--vocab-size", type=positive_int, default=1000,
                        help="random prompts draw token ids below this (the model's vocabulary must be as large)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")


def request_body(endpoint: str, model: str, request: BenchRequest, *, ignore_eos: bool = True,
                 extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The JSON of one streaming request: a completion (token ids or text) or a one-message chat."""
    body: dict[str, Any] = {"model": model, "max_tokens": request.output_len, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if endpoint == "chat":
        body.update(messages=[{"role": "user", "content": request.text}], max_completion_tokens=request.output_len)
    else:
        body["prompt"] = request.text if request.text is not None else request.prompt_token_ids
    return {**body, **(extra or {})}


def chunk_text(choice: dict[str, Any]) -> str:
    """The text a streamed choice carries: ``text`` in a completion, ``delta.content`` in a chat."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: Any, url: str, endpoint: str, body: dict[str, Any], input_tokens: int) -> RequestResult:
    """One streaming request; times every chunk that carries text."""
    result = RequestResult(input_tokens)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url + path, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                data = json.loads(line[len("data:"):])
                now = time.perf_counter()
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
                    result.input_tokens = data["usage"]["prompt_tokens"]
                if any(chunk_text(choice) for choice in data.get("choices", [])):
                    if chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    chunks, last = chunks + 1, now
    except Exception as exc:                   # a failed request is reported, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2el_s = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks       # servers without usage: one token per chunk
    return result


async def run_load(args: argparse.Namespace, rate: float, requests: list[BenchRequest],
                   advance: Any) -> tuple[float, list]:
    import httpx
    rng = random.Random(args.dataset_seed)
    limit = asyncio.Semaphore(args.max_concurrency or len(requests))
    url = args.base_url.rstrip("/")

    async def one(request: BenchRequest) -> RequestResult:
        body = request_body(args.endpoint, args.model, request, ignore_eos=args.ignore_eos, extra=args.extra_body)
        async with limit:
            result = await send(client, url, args.endpoint, body, len(request.prompt_token_ids))
        advance(1, result.output_tokens)
        return result

    # A fresh connection per request (no keep-alive): a pooled connection the server has closed as idle (llama.cpp's
    # server does after 5 s; a request that waited that long in its queue left one behind) fails the next request
    # sent on it with "Server disconnected without sending a response". Connecting on 127.0.0.1 costs well under
    # a millisecond, the same for every server measured.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - start, results


def distribution(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds."""
    import numpy as np
    if not values_s:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    ms = np.array(values_s) * 1000
    return {"mean_ms": float(ms.mean()), "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "p99_ms": float(np.percentile(ms, 99))}


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft_s * 1000, "tpot": result.tpot_s * 1000, "e2el": result.e2el_s * 1000}
    return result.error is None and all(values_ms[name] <= limit for name, limit in slos.items())


def summarize(seconds: float, results: list[RequestResult], slos: dict[str, float]) -> dict[str, Any]:
    done = [r for r in results if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    input_tokens = sum(r.input_tokens for r in done)
    summary: dict[str, Any] = {
        "duration_s": seconds, "completed": len(done), "failed": len(results) - len(done),
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(done) / seconds, "output_throughput": output_tokens / seconds,
        "total_token_throughput": (input_tokens + output_tokens) / seconds,
        "ttft": distribution([r.ttft_s for r in done]),
        "tpot": distribution([r.tpot_s for r in done if r.output_tokens > 1]),
        "itl": distribution([gap for r in done for gap in r.itl_s]),
        "e2el": distribution([r.e2el_s for r in done]),
    }
    if slos:
        good = sum(meets(r, slos) for r in results)
        summary.update(slos_ms=slos, good_requests=good, request_goodput=good / seconds)
    return summary


def run(args: argparse.Namespace) -> int:
    report.check_plot_possible(args.plot)
    if args.endpoint == "chat" and args.dataset in DATASETS:
        raise BenchError("--endpoint chat sends text: give --dataset FILE.jsonl (one {\"prompt\": ...} per line); "
                         "random token ids can only go to completions")
    rates, n = args.request_rate, args.num_prompts
    requests = make_requests(args.dataset, n * len(rates), args.input_len, args.output_len,
                             vocab_size=args.vocab_size, seed=args.dataset_seed)
    runs = []
    for i, rate in enumerate(rates):
        if len(rates) > 1:
            print(f"--- request rate {rate:g}/s")
        with report.progress_bar(f"rate {rate:g}/s", n) as advance:
            seconds, results = asyncio.run(run_load(args, rate, requests[i * n:(i + 1) * n], advance))
        summary = summarize(seconds, results, dict(args.goodput))
        print_summary(summary, [r.error for r in results if r.error])
        runs.append({"request_rate": str(rate), **summary, "requests": [asdict(r) for r in results]})
    workload = {**describe(args), "num_prompts": n, "max_concurrency": args.max_concurrency,
                "ignore_eos": args.ignore_eos, "extra_body": args.extra_body}
    if len(runs) == 1:
        record = {"bench": "serve", "base_url": args.base_url, "model": args.model,
                  "workload": {**workload, "request_rate": runs[0]["request_rate"]}, **runs[0]}
    else:
        record = {"bench": "serve-sweep", "base_url": args.base_url, "model": args.model,
                  "workload": {**workload, "request_rates": [r["request_rate"] for r in runs]}, "sweep": runs}
    report.write_json(args.output_json, record)
    if args.plot and len(runs) == 1:
        plot(record, args.plot)
    elif args.plot:
        plot_sweeps({record["model"]: record}, args.plot)
    return 0 if all(r["completed"] for r in runs) else 1


def print_summary(s: dict[str, Any], failures: list[str]) -> None:
    print(f"completed {s['completed']} requests ({s['failed']} failed) in {s['duration_s']:.2f} s: "
          f"{s['request_throughput']:.2f} requests/s, {s['output_throughput']:.1f} output tokens/s, "
          f"{s['total_token_throughput']:.1f} total tokens/s ({s['input_tokens']} in, {s['output_tokens']} out)")
    for name in ("ttft", "tpot", "itl", "e2el"):
        d = s[name]
        print(f"{name.upper():>5} ms: mean {d['mean_ms']:.1f}, median {d['median_ms']:.1f}, p90 {d['p90_ms']:.1f}, "
              f"p99 {d['p99_ms']:.1f}")
    if "request_goodput" in s:
        print(f"goodput: {s['good_requests']} requests met the SLOs {s['slos_ms']}: "
              f"{s['request_goodput']:.2f} requests/s")
    if failures:
        print(f"first failure: {failures[0]}")


def plot(record: dict[str, Any], path: str) -> None:
    """Latency CDFs: what share of requests (or token gaps) finished within x ms."""
    import numpy as np
    done = [r for r in record["requests"] if r["error"] is None]
    series = {"TTFT": [r["ttft_s"] for r in done], "ITL": [g for r in done for g in r["itl_s"]],
              "E2EL": [r["e2el_s"] for r in done]}
    fig, axes = report.new_figure(3, f"bench serve: {record['model']}, rate {record['workload']['request_rate']}/s")
    for ax, (name, values) in zip(axes, series.items()):
        ms = np.sort(np.array(values) * 1000)
        ax.plot(ms, np.arange(1, len(ms) + 1) / max(len(ms), 1), drawstyle="steps-post")
        ax.set_xlabel(f"{name} ms")
        ax.set_ylabel("share of requests" if name != "ITL" else "share of token gaps")
        ax.set_ylim(0, 1.02)
    report.save_figure(fig, path)


def rate_label(rate: str) -> str:
    return "inf" if rate == "inf" else f"{float(rate):g}"


def plot_sweeps(records: dict[str, dict[str, Any]], path: str, title: str = "bench serve: request-rate sweep") -> None:
    """Throughput, TTFT and TPOT against the request rate, one line per sweep (a server, or a configuration).

    Rates are placed evenly and labelled, so ``inf`` (all at once) can sit at the right end.
    """
    rates = list(dict.fromkeys(r["request_rate"] for rec in records.values() for r in rec["sweep"]))
    rates.sort(key=float)
    x = {rate: i for i, rate in enumerate(rates)}
    fig, (ax_tput, ax_ttft, ax_tpot) = report.new_figure(3, title)
    for (label, record), color in zip(records.items(), ("tab:blue", "tab:orange", "tab:green", "tab:red",
                                                           "tab:purple", "tab:brown")):
        sweep = record["sweep"]
        xs = [x[r["request_rate"]] for r in sweep]
        ax_tput.plot(xs, [r["output_throughput"] for r in sweep], "o-", color=color, label=label)
        for ax, metric in ((ax_ttft, "ttft"), (ax_tpot, "tpot")):
            ax.plot(xs, [r[metric]["median_ms"] for r in sweep], "o-", color=color, label=f"{label} median")
            ax.plot(xs, [r[metric]["p99_ms"] for r in sweep], "^:", color=color, label=f"{label} p99")
    for ax, ylabel in ((ax_tput, "output tokens/s"), (ax_ttft, "TTFT ms"), (ax_tpot, "TPOT ms")):
        ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    report.save_figure(fig, path)
