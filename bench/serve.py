"""The server's overhead: N concurrent clients against `minipaged serve` vs the same requests through
`Engine.generate` in-process, in one run, plus the resident memory of one `watch --attach` client.

Both sides get the same token-id prompts, all at once (a closed batch), greedy, ignore_eos, the same engine
options and threads. The in-process engine is released before the server starts, so the two never share
the CPU. TTFT on the server side is measured by the client: request sent -> first streamed text.

    python bench/serve.py [--model smollm2] [--clients 16] [--max-tokens 32]
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged.bench.requests import random_token_prompts
from minipaged import Engine, SamplingParams
from minipaged.bench.servers import free_port, minipaged_serve_command, running


def in_process(model: str, prompts: list[list[int]], max_tokens: int, options: dict) -> tuple[float, float, int]:
    """(seconds, mean TTFT seconds, output tokens) for Engine.generate on all prompts at once."""
    engine = Engine(model, **options)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)     # warm-up
    engine.reset_prefix_cache()
    start = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, statistics.mean(o.metrics.ttft for o in outs), sum(len(o.token_ids) for o in outs)


async def one_client(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                     max_tokens: int) -> tuple[float, int]:
    """(TTFT seconds, completion tokens) of one streamed request."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft or float("nan"), tokens


async def through_server(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int]:
    async with httpx.AsyncClient(timeout=600) as http:
        await one_client(http, url, model, prompts[0], 2)                                        # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*[one_client(http, url, model, p, max_tokens) for p in prompts])
        seconds = time.perf_counter() - start
    return seconds, statistics.mean(r[0] for r in results), sum(r[1] for r in results)


def attach_rss_mb(url: str, seconds: float = 4.0) -> float:
    """Peak resident memory of `minipaged watch --attach URL --no-tui` after it has drawn a few seconds."""
    proc = subprocess.Popen([sys.executable, "-m", "minipaged", "watch", "--attach", url, "--no-tui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(seconds)
    with open(f"/proc/{proc.pid}/status") as status:
        peak_kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    proc.terminate()
    proc.wait(10)
    return peak_kb / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    options = {"num_threads": args.threads}
    prompts = random_token_prompts(args.clients, 40, 120, seed=0, vocab=256)

    engine_s, engine_ttft, engine_tokens = in_process(args.model, prompts, args.max_tokens, options)
    gc.collect()

    # The server is started as a user would, and always stopped; one that exits or never answers fails the
    # run with its log instead of leaving it waiting.
    port = free_port()
    command = minipaged_serve_command(args.model, port, ["--threads", str(args.threads), "--served-model-name",
                                                         "bench"])
    with tempfile.TemporaryDirectory() as tmp, \
            running(command, port, what="minipaged serve", log_path=os.path.join(tmp, "serve.log")) as url:
        server_s, server_ttft, server_tokens = asyncio.run(through_server(url, "bench", prompts, args.max_tokens))
        rss = attach_rss_mb(url)
    assert engine_tokens == server_tokens == args.clients * args.max_tokens
    engine_tps, server_tps = engine_tokens / engine_s, server_tokens / server_s
    loss = 1 - server_tps / engine_tps
    md = (f"### Server overhead: {args.clients} concurrent clients, prompts 40-120 tokens, {args.max_tokens} new "
          f"tokens each (ignore_eos, greedy), {args.model}\n\n{machine_line()}\n\n"
          + table(["path", "seconds", "output tok/s", "mean TTFT s"],
                  [["Engine.generate, in-process", engine_s, engine_tps, engine_ttft],
                   [f"minipaged serve, {args.clients} streaming HTTP clients", server_s, server_tps, server_ttft]])
          + f"\n\n**throughput lost to the server: {loss:.1%}** (target: under 10% at 16 clients); TTFT "
          f"{server_ttft / engine_ttft:.2f}x in-process.\n\nPeak resident memory of one `watch --attach --no-tui` "
          f"client: **{rss:.0f} MB** (target: under 100 MB).")
    print(md)
    save("serve", {"engine_s": engine_s, "engine_tok_s": engine_tps, "engine_ttft_s": engine_ttft,
                   "server_s": server_s, "server_tok_s": server_tps, "server_ttft_s": server_ttft,
                   "throughput_loss": loss, "attach_rss_mb": rss, "clients": args.clients,
                   "max_tokens": args.max_tokens, "model": args.model}, md)


if __name__ == "__main__":
    main()
