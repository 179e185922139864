"""The tuning walkthrough's machinery: a fresh ``minipaged serve`` per configuration, benched by
``minipaged bench serve``, with the server's own counters read around the run.

``bench/tuning.py`` (the seed guide's steps) and ``bench/peer.py`` (the same requests against
``transformers serve``) are scripts made of steps on top of this module; ``main`` runs the steps chosen on
the command line, merges their values into docs/tuning.json and renders the docs from it.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from . import docs, report
from .servers import free_port, metric_totals, minipaged_serve_command, running

SERVED_NAME = "smollm2"     # what `minipaged serve --model smollm2`, the command the docs show, serves
COUNTERS = {        # what the client cannot see, from minipaged's /metrics (vLLM's names)
    "preemptions": "minipaged:num_preemptions_total",
    "prefill_tokens_computed": "minipaged:prompt_tokens_total",
    "prefix_queries": "minipaged:prefix_cache_queries_total",
    "prefix_hits": "minipaged:prefix_cache_hits_total",
    "draft_tokens": "minipaged:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "minipaged:spec_decode_num_accepted_tokens_total",
}


@dataclass
class Context:
    model: str                  # what `minipaged serve --model` gets
    model_dir: str              # the local folder (transformers serve loads it too)
    vocab_size: int
    threads: int
    quick: bool
    workdir: Path
    out: Path                   # the JSON and the pictures go here (docs/, unless a trial run says otherwise)
    runs: dict[str, Any] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        return {**os.environ, "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"}

    def scale(self, full: int, quick: int) -> int:
        return quick if self.quick else full


# ------------------------------------------------------------------------------------------ running one config

def warm_up(url: str, model: str, extra: Optional[dict[str, Any]] = None, ignore_eos: bool = True) -> None:
    """One short request first: lazy loading and first-call costs stay out of the measurement."""
    import httpx

    from minipaged.bench.requests import BenchRequest
    from minipaged.bench.serve import request_body
    body = request_body("completions", model, BenchRequest([], 4, "Hello, how are you?"), ignore_eos=ignore_eos,
                        extra=extra)
    body.update(stream=False)
    body.pop("stream_options")
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"warm-up request to {url} failed: HTTP {response.status_code} {response.text[:300]}")


def bench(url: str, model: str, bench_args: list[str], out: Path) -> dict[str, Any]:
    """``minipaged bench serve`` against ``url``; the JSON it wrote."""
    from minipaged.cli import main
    status = main(["bench", "serve", "--base-url", url, "--model", model, *bench_args, "--output-json", str(out)])
    record = json.loads(out.read_text())
    if status != 0 or any(r.get("failed") for r in record.get("sweep", [record])):
        raise RuntimeError(f"bench serve failed against {url} (status {status}); see {out}")
    return record


def run_config(ctx: Context, step: str, label: str, server_flags: list[str], bench_args: list[str]) -> dict[str, Any]:
    """A fresh ``minipaged serve`` with ``server_flags``, warmed up, benched; the record plus the server's
    counters over the run."""
    port = free_port()
    command = minipaged_serve_command(ctx.model, port, ["--threads", str(ctx.threads), "--served-model-name",
                                                        SERVED_NAME, *server_flags])
    log = ctx.workdir / f"{step}-{label}.log".replace(" ", "_")
    print(f"\n=== {step}: {label}: minipaged serve {' '.join(server_flags)}", flush=True)
    with running(command, port, what=f"minipaged serve ({label})", log_path=str(log), env=ctx.env(),
                 timeout_s=300) as url:
        warm_up(url, SERVED_NAME)
        before = metric_totals(url)
        record = bench(url, SERVED_NAME, bench_args, ctx.workdir / f"{step}-{label}.json".replace(" ", "_"))
        after = metric_totals(url)
    record["server_counters"] = {name: after.get(key, 0.0) - before.get(key, 0.0) for name, key in COUNTERS.items()}
    record["server_flags"] = server_flags
    return record


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """The numbers a step reports from one run (a single rate)."""
    c = record.get("server_counters", {})
    return {"output_tps": record["output_throughput"], "request_tps": record["request_throughput"],
            "ttft_med": record["ttft"]["median_ms"], "ttft_p99": record["ttft"]["p99_ms"],
            "tpot_med": record["tpot"]["median_ms"], "tpot_p99": record["tpot"]["p99_ms"],
            "itl_med": record["itl"]["median_ms"], "itl_p99": record["itl"]["p99_ms"],
            "e2el_med": record["e2el"]["median_ms"], "duration_s": record["duration_s"],
            "completed": record["completed"], "input_tokens": record["input_tokens"],
            "output_tokens": record["output_tokens"], **c}


def change(new: float, old: float) -> str:
    """'2.10x lower' / '1.30x higher' / 'about the same' (within 3%): how ``new`` compares with ``old``, in words."""
    if old == 0 or new == 0:
        return "not comparable (a zero)"
    ratio = new / old
    if 0.97 <= ratio <= 1.03:
        return "about the same"
    return f"{ratio:.2f}x higher" if ratio > 1 else f"{1 / ratio:.2f}x lower"


def rate_words(rate: str) -> str:
    return "all at once" if rate == "inf" else f"{float(rate):g} requests/s"


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """The walkthrough's tables: milliseconds and tokens/s to one decimal, with thousands separators."""
    return report.markdown_table(headers, rows, number=",.1f")


def bars(path: Path, title: str, labels: list[str], panels: list[tuple[str, list[float]]]) -> None:
    """One bar chart per metric, configurations side by side."""
    fig, axes = report.new_figure(len(panels), title)
    for ax, (name, values) in zip(axes, panels):
        ax.bar(labels, values, color="tab:blue")
        ax.set_title(name, fontsize=10)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    report.save_figure(fig, str(path))


def command_line(bench_args: list[str]) -> str:
    words = [f"'{w}'" if w.startswith("{") else w for w in bench_args]
    return f"minipaged bench serve --base-url http://127.0.0.1:8000 --model {SERVED_NAME} " + " ".join(words)


def write_prompts(ctx: Context, name: str, prompts: list[str]) -> str:
    path = ctx.workdir / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts), encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------------------------------------------ main

def server_machine_line(threads: int) -> str:
    """The machine as the docs print it, with the torch threads each server gets (not this process's)."""
    m = report.machine()
    return (f"{m['machine']}, {m['cpu_count']} cores, torch {m['torch']}, {threads} threads per server, "
            + (m["gpu"] or "no GPU"))


def resolve(model: str) -> tuple[str, int]:
    """The model's local folder (converting the embedded GGUF on first use) and its vocabulary size."""
    from minipaged.model.loader import resolve_model_path
    path, _ = resolve_model_path(model, progress=print)
    return str(path), json.loads((path / "config.json").read_text())["vocab_size"]


def main(step_functions: dict[str, Callable[[Context], dict[str, Any]]], description: str,
         argv: Optional[list[str]] = None) -> int:
    """Run the chosen steps, merge their values into docs/tuning.json (a step not run keeps its numbers), and
    render the docs from it (``docs.write_all``); a trial run with ``--out`` elsewhere renders nothing."""
    steps = list(step_functions)
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="what the servers serve")
    ap.add_argument("--only", nargs="+", choices=steps, default=steps, help="run these steps only")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of each server")
    ap.add_argument("--quick", action="store_true", help="small workloads (with a tiny --model: a plumbing check)")
    ap.add_argument("--conditions", default="a quiet machine",
                    help="said in the docs beside the numbers, e.g. 'three other jobs shared the CPU'")
    ap.add_argument("--out", type=Path, default=docs.DOCS,
                    help="folder for tuning.json and the pictures; the docs are rendered only when it is docs/")
    args = ap.parse_args(argv)
    model_dir, vocab = resolve(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / docs.RESULTS.name
    existing = json.loads(results.read_text()) if results.exists() else {"values": {}, "runs": {}}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minipaged-tuning-") as tmp:
        ctx = Context(args.model, model_dir, vocab, args.threads, args.quick, Path(tmp), args.out)
        values: dict[str, Any] = {}
        for step in args.only:
            step_start = time.perf_counter()
            values.update(step_functions[step](ctx))
            values[f"{step}_seconds"] = time.perf_counter() - step_start
    values.update(model=args.model, machine=server_machine_line(args.threads), conditions=args.conditions,
                  when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    merged = {"values": {**existing["values"], **values}, "runs": {**existing["runs"], **ctx.runs}}
    results.write_text(json.dumps(merged, indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {results} ({time.perf_counter() - start:.0f} s)")
    if args.out.resolve() == docs.DOCS:
        docs.write_all(merged["values"])
    else:
        print("(a trial run outside docs/: the docs are left as they are)")
    return 0
