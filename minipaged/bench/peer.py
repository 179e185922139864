"""A peer comparison: ``minipaged serve`` vs ``transformers serve --continuous-batching``, same model, same requests.

A step of the tuning walkthrough (``bench/tuning.py`` runs it last; ``bench/peer.py`` runs it alone). It
updates docs/tuning.json, from which docs/performance.md's peer section is rendered.

Both servers load the same local folder (the embedded SmolLM2, converted once to safetensors), run on the
CPU with the same number of torch threads, one after the other, each warmed up by one request. Both get the
same text prompts through ``minipaged bench serve`` (streaming ``/v1/completions``) at each rate, and must
make exactly the same number of tokens: minipaged through ``ignore_eos``; transformers serve refuses that
field (HTTP 422, unknown fields are errors there), so it gets ``--no-ignore-eos`` and a per-request
``generation_config`` whose ``eos_token_id`` is -1, which its continuous batching reads as "no EOS".
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from ..workloads import QUESTIONS, SENTENCES
from . import walkthrough
from .servers import free_port, running, transformers_serve_command

NO_EOS = {"generation_config": json.dumps({"eos_token_id": -1})}     # transformers serve's way to ignore EOS
LABELS = ("minipaged serve", "transformers serve")
# The peer's KV pool and token budget, set to minipaged's CPU defaults (1 GiB of KV, 2048 tokens per step):
# left to itself, transformers serve sizes both for a GPU and took 13 GB of RAM here for SmolLM2. Its blocks
# hold 256 tokens; SmolLM2's fp32 KV is 46 KB per token, so 90 blocks are about 1 GiB.
PEER_FLAGS = ["--continuous-batching", "--cb-num-blocks", "90", "--cb-max-batch-tokens", "2048"]


def distinct_prompts(n: int, seed: int = 0) -> list[str]:
    """Prompts that share no long prefix (notes in a shuffled order, then a question), so prefix caching,
    which both servers have, finds nothing and both do the same prefill work."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        notes = rng.sample(SENTENCES, 6)
        prompts.append("Notes: " + " ".join(notes) + f"\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:")
    return prompts


def model_dir_for_transformers(ctx: "walkthrough.Context") -> str:
    """The model folder as transformers serve can load it.

    transformers serve picks the model class from ``architectures`` in config.json and fails with "'NoneType'
    object is not subscriptable" without it. minipaged's conversion of the embedded GGUF wrote ``null`` there
    until the loader learned to fill it in; for a folder that still lacks it, transformers serve gets a
    folder of links to the same files with ``architectures`` filled in (same weights, tokenizer, template).
    """
    source = Path(ctx.model_dir)
    config = json.loads((source / "config.json").read_text())
    if config.get("architectures"):
        return str(source)
    folder = ctx.workdir / "peer-model"
    folder.mkdir(exist_ok=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item.resolve())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}, indent=2))
    return str(folder)


def run_transformers(ctx: "walkthrough.Context", bench_args: list[str]) -> dict[str, Any]:
    port = free_port()
    model_dir = model_dir_for_transformers(ctx)
    command = transformers_serve_command(model_dir, port, [*PEER_FLAGS, "--log-level", "warning"])
    log = ctx.workdir / "peer-transformers.log"
    print(f"\n=== peer: transformers serve {model_dir} {' '.join(PEER_FLAGS)}", flush=True)
    with running(command, port, what="transformers serve", log_path=str(log), env=ctx.env(), timeout_s=300) as url:
        walkthrough.warm_up(url, model_dir, extra=NO_EOS, ignore_eos=False)
        return walkthrough.bench(url, model_dir, [*bench_args, "--no-ignore-eos", "--extra-body", json.dumps(NO_EOS)],
                            ctx.workdir / "peer-transformers.json")


def wins(sweep: list[dict[str, Any]], other: list[dict[str, Any]]) -> list[str]:
    """Where ``sweep`` did better than ``other`` (same rates), per rate and metric, in words."""
    found = []
    better = 1.03                 # a 3% margin: closer than that is a tie on this noisy machine
    for b, a in zip(sweep, other):
        rate = walkthrough.rate_words(a["request_rate"])
        if b["output_throughput"] > a["output_throughput"] * better:
            found.append(f"output throughput at {rate} ({b['output_throughput']:.1f} vs {a['output_throughput']:.1f} "
                         f"tokens/s)")
        for metric, name in (("ttft", "median TTFT"), ("tpot", "median TPOT")):
            if b[metric]["median_ms"] * better < a[metric]["median_ms"]:
                found.append(f"{name} at {rate} ({b[metric]['median_ms']:,.0f} vs {a[metric]['median_ms']:,.0f} ms)")
    return found


def in_words(found: list[str]) -> str:
    return "; ".join(found) + "." if found else "none of the measured numbers at any rate."


def run(ctx: "walkthrough.Context") -> dict[str, Any]:
    from .serve import plot_sweeps
    n = ctx.scale(10, 3)
    rates = ["1", "2", "4"] if not ctx.quick else ["4", "inf"]
    prompts = walkthrough.write_prompts(ctx, "distinct", distinct_prompts(n * len(rates)))
    bench_args = ["--dataset", prompts, "--num-prompts", str(n), "--output-len", str(ctx.scale(32, 6)),
                  "--request-rate", *rates]
    records = {LABELS[0]: walkthrough.run_config(ctx, "peer", "minipaged", [], bench_args),
               LABELS[1]: run_transformers(ctx, bench_args)}
    ours, theirs = (records[label]["sweep"] for label in LABELS)
    same_output = [r["output_tokens"] for r in ours] == [r["output_tokens"] for r in theirs]
    if not same_output:
        raise RuntimeError("the two servers made different numbers of tokens; the comparison would not be fair")
    same_prompts = all([q["input_tokens"] for q in a["requests"]] == [q["input_tokens"] for q in b["requests"]]
                       for a, b in zip(ours, theirs))
    ctx.runs["peer"] = {label: [{k: v for k, v in r.items() if k != "requests"} for r in rec["sweep"]]
                        for label, rec in records.items()}
    plot_sweeps(records, str(ctx.out / "peer.png"),
                "minipaged serve vs transformers serve (continuous batching), same requests, SmolLM2, CPU")
    rows = []
    for a, b in zip(ours, theirs):
        for label, r in ((LABELS[0], a), (LABELS[1], b)):
            rows.append([walkthrough.rate_words(r["request_rate"]), label, r["output_throughput"], r["ttft"]["median_ms"],
                         r["ttft"]["p99_ms"], r["tpot"]["median_ms"], r["tpot"]["p99_ms"]])
    shown = bench_args.copy()
    shown[shown.index(prompts)] = "distinct.jsonl"
    return {
        "peer_cmd": walkthrough.command_line(shown), "peer_flags": " ".join(PEER_FLAGS), "peer_num_prompts": n,
        "peer_prompt_tokens": sum(r["input_tokens"] for r in ours) / (n * len(rates)),
        "peer_output_len": int(bench_args[bench_args.index("--output-len") + 1]),
        "peer_same_prompt_tokens": "yes" if same_prompts else "no (see docs/walkthrough.json)",
        "peer_table": walkthrough.table(["rate", "server", "output tok/s", "TTFT median ms", "TTFT p99 ms",
                                    "TPOT median ms", "TPOT p99 ms"], rows),
        "peer_wins": in_words(wins(theirs, ours)), "peer_ours_wins": in_words(wins(ours, theirs)),
        "peer_tps_ratio_last": ours[-1]["output_throughput"] / theirs[-1]["output_throughput"],
        "peer_tps_ratio_first": ours[0]["output_throughput"] / theirs[0]["output_throughput"],
        "peer_rate_first": walkthrough.rate_words(ours[0]["request_rate"]),
        "peer_rate_last": walkthrough.rate_words(ours[-1]["request_rate"]),
    }
