"""The server's overhead: N concurrent clients against `minipaged serve` vs the same requests through
`Engine.generate` in-process, plus the resident memory of one `watch --attach` client.

Both sides get the same token-id prompts, all at once (a closed batch), greedy, ignore_eos, the same engine
options and threads. TTFT on the server side is measured by the client: request sent -> first streamed text.

These machines are shared and noisy, so one in-process run followed by one server run compares two different
moments. ``--rounds N`` alternates them (in-process, server, in-process, server, ...) and reports the ratio of
each adjacent pair and their median. Both engines stay loaded for the whole run; while one side runs the other
is idle (the idle server's engine thread sleeps on its command queue), so they never share the CPU.

    python bench/serve.py [--model smollm2 | --tiny] [--clients 16] [--max-tokens 32] [--rounds 3]

The wall-clock ratio needs a quiet machine; the CPU time each side spends on the same tokens (all the server's
threads) does not, and is reported beside it.

``--tiny`` serves a tiny random checkpoint, whose forward costs next to nothing: what is left is the host's work
per token, the regime of a fast GPU (the seed's hardware), where a server that adds Python per token shows.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time


from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged.bench.requests import random_token_prompts
from minipaged import Engine, SamplingParams
from minipaged.bench.servers import free_port, minipaged_serve_command, running
from minipaged.bench.streams import pid_of_server, stream_all


def warm_engine(model: str, prompts: list[list[int]], options: dict) -> Engine:
    engine = Engine(model, **options)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)     # warm-up
    return engine


def in_process(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, float, int, float]:
    """(seconds, mean TTFT seconds, output tokens, CPU seconds) for Engine.generate on all prompts at once."""
    engine.reset_prefix_cache()           # cold, as the server's is for these prompts (new in every round)
    start, cpu = time.perf_counter(), time.process_time()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, statistics.mean(o.metrics.ttft for o in outs), sum(len(o.token_ids) for o in outs), cpu


def as_tuple(served) -> tuple[float, float, int, float, float, float]:
    """(seconds, mean TTFT seconds, output tokens, the server's CPU seconds, its engine core's CPU seconds, the
    clients' CPU seconds) of one round (minipaged.bench.streams, shared with lesson 12)."""
    return (served.seconds, served.mean_ttft_s, served.tokens, served.server_cpu_s, served.core_cpu_s,
            served.clients_cpu_s)


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
    ap.add_argument("--tiny", action="store_true", help="a tiny random checkpoint: the host's work dominates")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=1, help="alternating in-process / server pairs (median ratio)")
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    if args.tiny:
        from minipaged.model.testing import build_tiny_llama
        args.model = str(build_tiny_llama(tempfile.mkdtemp(prefix="serve-bench-"), tie_word_embeddings=True))
    options = {"num_threads": args.threads}
    # New prompts in every round: the server's prefix cache would otherwise hold the last round's.
    rounds = [random_token_prompts(args.clients, 40, 120, seed=r, vocab=256) for r in range(args.rounds)]
    engine = warm_engine(args.model, rounds[0], options)

    # The server is started as a user would, and always stopped; one that exits or never answers fails the
    # run with its log instead of leaving it waiting.
    # Beside it, the same server with its engine core in a thread of its own process (--core-in-thread, as
    # minipaged served before it had two processes): what the second process is worth, in the same rounds.
    port, one_port = free_port(), free_port()
    flags = ["--threads", str(args.threads), "--served-model-name", "bench"]
    pairs, one_process = [], []
    with tempfile.TemporaryDirectory() as tmp, \
            running(minipaged_serve_command(args.model, port, flags), port, what="minipaged serve",
                    log_path=os.path.join(tmp, "serve.log")) as url, \
            running(minipaged_serve_command(args.model, one_port, flags + ["--core-in-thread"]), one_port,
                    what="minipaged serve --core-in-thread", log_path=os.path.join(tmp, "serve-one.log")) as one_url:
        for prompts in rounds:
            local = in_process(engine, prompts, args.max_tokens)
            gc.collect()
            served = as_tuple(stream_all(url, "bench", prompts, args.max_tokens, pid_of_server(port)))
            gc.collect()
            one = as_tuple(stream_all(one_url, "bench", prompts, args.max_tokens, pid_of_server(one_port)))
            assert local[2] == served[2] == one[2] == args.clients * args.max_tokens
            pairs.append((local, served))
            one_process.append(one)
        rss = attach_rss_mb(url)
    ratios = [local[0] / served[0] for local, served in pairs]       # served tok/s over in-process tok/s
    cpu_ratios = [served[3] / local[3] for local, served in pairs]   # the server's CPU per token over in-process
    core_ratios = [served[4] / local[3] for local, served in pairs]  # ... its engine core's alone
    api_ratios = [(served[3] - served[4]) / local[3] for local, served in pairs]   # ... its API server's alone
    clients_ratios = [served[5] / local[3] for local, served in pairs]   # the clients' (this process) CPU
    # the two processes' tok/s over one process's, and the one process's CPU per token over in-process
    two_over_one = [one[0] / served[0] for (_local, served), one in zip(pairs, one_process)]
    one_cpu_ratios = [one[3] / local[3] for (local, _served), one in zip(pairs, one_process)]
    middle = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]    # the median pair
    (engine_s, engine_ttft, engine_tokens, _), (server_s, server_ttft, server_tokens, *_) = pairs[middle]
    engine_tps, server_tps = engine_tokens / engine_s, server_tokens / server_s
    loss = 1 - server_tps / engine_tps
    cpu_ratio = statistics.median(cpu_ratios)
    model = "tiny random Llama" if args.tiny else args.model
    rows = [[f"round {i + 1}", local[2] / local[0], served[2] / served[0], ratio, served[1] / local[1], cpu,
             core_ratios[i], api_ratios[i], clients_ratios[i], two_over_one[i], one_cpu_ratios[i]]
            for i, ((local, served), ratio, cpu) in enumerate(zip(pairs, ratios, cpu_ratios))]
    md = (f"### Server overhead: {args.clients} concurrent clients, prompts 40-120 tokens, {args.max_tokens} new "
          f"tokens each (ignore_eos, greedy), {model}\n\n{machine_line()}\n\n"
          + table(["path", "seconds", "output tok/s", "mean TTFT s"],
                  [["Engine.generate, in-process", engine_s, engine_tps, engine_ttft],
                   [f"minipaged serve, {args.clients} streaming HTTP clients", server_s, server_tps, server_ttft]])
          + "\n\n" + table(["alternating pair", "in-process tok/s", "served tok/s", "served / in-process",
                                "TTFT served / in-process", "server CPU / in-process CPU", "its engine core's",
                                "its API server's", "the clients' CPU", "two processes / one (tok/s)",
                                "one process's CPU / in-process"], rows)
          + f"\n\n**throughput lost to the server: {loss:.1%}** (the median of {len(pairs)} alternating pairs; "
          f"target: under 10%); TTFT {server_ttft / engine_ttft:.2f}x in-process. CPU time for the same tokens "
          f"(all the server's threads, which other work on the machine does not inflate): **{cpu_ratio:.2f}x** "
          f"in-process: its engine core's process {statistics.median(core_ratios):.2f}x, its API server's "
          f"{statistics.median(api_ratios):.2f}x. The clients (one Python process on the same machine) spent "
          f"{statistics.median(clients_ratios):.2f}x. The same server with its engine core in a thread of its "
          f"own process (--core-in-thread, one GIL for both) delivered "
          f"{1 / statistics.median(two_over_one):.2f}x the two processes' tokens per second, at "
          f"{statistics.median(one_cpu_ratios):.2f}x the in-process CPU per token.\n\nPeak resident memory of one `watch --attach --no-tui` client: **{rss:.0f} MB** "
          f"(target: under 100 MB).")
    print(md)
    save("serve_tiny" if args.tiny else "serve",
         {"engine_s": engine_s, "engine_tok_s": engine_tps, "engine_ttft_s": engine_ttft, "server_s": server_s,
          "server_tok_s": server_tps, "server_ttft_s": server_ttft, "throughput_loss": loss,
          "served_over_in_process": ratios, "server_cpu_over_in_process": cpu_ratios,
          "server_cpu_ratio": cpu_ratio, "core_cpu_over_in_process": core_ratios,
          "api_server_cpu_over_in_process": api_ratios, "clients_cpu_over_in_process": clients_ratios,
          "two_processes_over_one": two_over_one, "one_process_cpu_over_in_process": one_cpu_ratios,
          "attach_rss_mb": rss, "clients": args.clients,
          "max_tokens": args.max_tokens, "rounds": args.rounds, "model": model}, md)


if __name__ == "__main__":
    main()
