"""Routing with the cache in mind: a multi-tenant workload through sglang-router, per policy and fleet size.

Several tenants, each with its own long system prompt, and many users per tenant asking short questions, in a
shuffled order with a few requests in flight. Each replica's KV pool holds only some tenants' prefixes, as in
a real fleet. ``round_robin`` and ``power_of_two`` send every tenant everywhere, so each replica's cache keeps
evicting prefixes it will need again; ``cache_aware`` sends a tenant where its prefix already is. Measured per
run, on fresh replicas: the fleet's prefix-cache hit rate (prompt tokens found in a cache over prompt tokens
looked up, summed over the replicas' own Prometheus counters), TTFT p50/p99 and output throughput seen by the
client (wall clock on this machine: noisy where other work shares the cores), and how many requests each
replica served.

    python bench/fleet.py [--model smollm2] [--replicas 2 3] [--policies round_robin power_of_two cache_aware]
    python bench/fleet.py --model smollm2 --system-words 360 --out fleet_smollm2 \
        --serve-args "--threads 1 --block-size 16 --num-blocks 128 --max-model-len 2048"

The default model is a tiny random Llama with a byte tokenizer (built here, no download): the hit rate depends
on the tokens and the routing only, not on the weights; its times are not a real model's. On SmolLM2 a word is
about a sixth of the bytes' tokens, so the second command asks for six times the words: the same pool then holds
about as many tenants' prefixes, and the JSON goes to bench/out/fleet_smollm2.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from minipaged.bench.report import markdown_table, percentile, save
from minipaged.bench.servers import free_port, metric_totals
from minipaged.fleet.processes import ChildProcesses
from minipaged.fleet.replicas import start_replicas
from minipaged.fleet.router import check_installed, start_router

TOPICS = ["a bakery", "a bicycle repair shop", "a city library", "a hiking club", "a school orchestra",
          "a vegetable farm", "a dental clinic", "a chess society"]


def tenants(count: int, words: int, rng: random.Random) -> list[str]:
    """One system prompt per tenant: its own opening, then a long, tenant-specific body of rules."""
    vocab = "please answer politely briefly clearly with care about our opening hours prices and services".split()
    return [f"You are the assistant of {TOPICS[t % len(TOPICS)]} (tenant {t}). Rules: "
            + " ".join(rng.choice(vocab) for _ in range(words)) for t in range(count)]


def workload(systems: list[str], users: int, rng: random.Random) -> list[list[dict[str, str]]]:
    requests = [[{"role": "system", "content": s}, {"role": "user", "content": f"Question {u} from user {u * 7 + t}?"}]
                for t, s in enumerate(systems) for u in range(users)]
    rng.shuffle(requests)
    return requests


async def one(client: httpx.AsyncClient, url: str, model: str, messages: list, max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                tokens += 1
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - start, "tokens": tokens}


async def drive(url: str, model: str, requests: list, concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def gated(messages: list) -> dict:
            async with gate:
                return await one(client, url, model, messages, max_tokens)
        start = time.perf_counter()
        results = await asyncio.gather(*[gated(m) for m in requests])
    return list(results), time.perf_counter() - start


def run_one(args: argparse.Namespace, replicas: int, policy: str, requests: list, log_dir: Path) -> dict:
    children = ChildProcesses(log_dir)
    try:
        started = start_replicas(children, replicas, args.model, args.serve_args + " --served-model-name fleet")
        port = free_port()
        start_router(children, "127.0.0.1", port, [r.url for r in started], policy)
        before = [metric_totals(r.url) for r in started]
        results, wall = asyncio.run(drive(f"http://127.0.0.1:{port}", "fleet", requests, args.concurrency,
                                          args.max_tokens))
        after = [metric_totals(r.url) for r in started]
    finally:
        children.stop_all()

    def delta(name: str, i: int) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)
    hits = sum(delta("minipaged:prefix_cache_hits_total", i) for i in range(replicas))
    queries = sum(delta("minipaged:prefix_cache_queries_total", i) for i in range(replicas))
    ttfts = [r["ttft_s"] for r in results]
    return {"replicas": replicas, "policy": policy, "requests": len(results),
            "hit_rate": hits / queries if queries else 0.0, "prompt_tokens_hit": hits, "prompt_tokens_queried": queries,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "output_tokens_per_s": sum(r["tokens"] for r in results) / wall, "wall_s": wall,
            "served_per_replica": [int(delta("minipaged:request_success_total", i)) for i in range(replicas)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: a tiny random Llama built here")
    ap.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--policies", nargs="+", default=["round_robin", "power_of_two", "cache_aware"])
    ap.add_argument("--tenants", type=int, default=6)
    ap.add_argument("--users", type=int, default=8, help="requests per tenant")
    ap.add_argument("--system-words", type=int, default=60, help="words in each tenant's system prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default="fleet", help="the result's name: bench/out/OUT.json and .md")
    ap.add_argument("--serve-args", default="--threads 1 --block-size 16 --num-blocks 128",
                    help="each replica's flags: its pool holds only some tenants' prefixes")
    args = ap.parse_args()
    check_installed()
    work = Path(tempfile.mkdtemp(prefix="minipaged-bench-fleet-"))
    if args.model is None:
        from minipaged.model.testing import build_tiny_llama
        args.model = str(build_tiny_llama(work / "tiny"))
    rng = random.Random(0)
    requests = workload(tenants(args.tenants, args.system_words, rng), args.users, rng)
    runs = []
    for replicas in args.replicas:
        for policy in args.policies:
            runs.append(run_one(args, replicas, policy, requests, work))
            print(f"{replicas} replicas, {policy}: hit rate {runs[-1]['hit_rate']:.1%}", flush=True)
    md = (f"### A multi-tenant workload through sglang-router: {args.tenants} tenants x {args.users} users, "
          f"{args.concurrency} in flight, {args.model if '/' not in args.model else 'a tiny random Llama'}\n\n"
          + markdown_table(["replicas", "policy", "prefix-cache hit rate", "TTFT p50 (s)", "TTFT p99 (s)",
                            "output tok/s", "requests per replica"],
                           [[r["replicas"], r["policy"], f"{r['hit_rate']:.1%}", r["ttft_p50_s"], r["ttft_p99_s"],
                             r["output_tokens_per_s"], " / ".join(map(str, r["served_per_replica"]))] for r in runs])
          + "\n\nTimes are wall clock on a shared machine; the hit rates depend on the routing only.")
    save(args.out, {"args": vars(args), "runs": runs}, md)


if __name__ == "__main__":
    main()
