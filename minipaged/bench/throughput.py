"""``minipaged bench throughput``: how many requests and tokens per second an offline batch gets through.

All requests are queued at once and run to completion in-process, the way ``vllm bench throughput`` measures
an engine without a server in between. ``--baseline transformers`` then runs transformers' padded
``generate`` on the very same token ids in the same process, so the ratio compares like with like on a
machine whose absolute speed may be noisy.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..options import add_engine_arguments, build_engine, engine_options
from . import report
from .baseline import hf_padded_generate
from .requests import DATASETS, BenchError, describe, make_requests, parse_length, positive_int
from .run import run_requests, warm_up


def add_workload_arguments(parser: argparse.ArgumentParser, *, input_len: str, output_len: str) -> None:
    """The flags that say which requests to send (shared by the offline benches)."""
    group = parser.add_argument_group("workload")
    group.add_argument("--input-len", type=parse_length, default=parse_length(input_len),
                       help="prompt tokens per request: N, or LO:HI drawn uniformly")
    group.add_argument("--output-len", type=parse_length, default=parse_length(output_len),
                       help="output tokens per request (EOS ignored, so exact): N, or LO:HI")
    group.add_argument("--dataset", default="random", metavar="|".join(DATASETS) + "|FILE.jsonl",
                       help="where prompts come from: random ids, random ids after a shared prefix, or a "
                            "JSON-lines file of {\"prompt\": ...}")
    group.add_argument("--dataset-seed", type=int, default=0, help="the same seed gives the same requests")
    group.add_argument("--output-json", metavar="FILE", help="write the result (exact token counts) as JSON")
    group.add_argument("--plot", metavar="FILE.png", help="draw the result (needs matplotlib)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser, input_len="40:400", output_len="16:128")
    parser.add_argument("--num-prompts", type=positive_int, default=64, help="requests in the batch")
    parser.add_argument("--baseline", choices=("none", "transformers"), default="none",
                        help="also run transformers' padded generate on the same requests and print the ratio")
    parser.add_argument("--baseline-batch-size", type=positive_int, default=16,
                        help="requests per padded transformers batch")
    parser.add_argument("--record", metavar="FILE.jsonl",
                        help="also save the run's steps as a trace (written after the run, so it costs the "
                             "measurement nothing): draw it with `minipaged plot FILE.jsonl`")
    add_engine_arguments(parser)


def rates(seconds: float, num_requests: int, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {"seconds": seconds, "num_requests": num_requests, "input_tokens": input_tokens,
            "output_tokens": output_tokens, "requests_per_s": num_requests / seconds,
            "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (input_tokens + output_tokens) / seconds}


def run(args: argparse.Namespace) -> int:
    report.check_plot_possible(args.plot)
    engine = build_engine(args.model, engine_options(args), progress=lambda m: report.err.print(f"[dim]{m}[/]"))
    if args.baseline == "transformers" and engine.loaded.hf_model is None:
        raise BenchError("--baseline transformers runs the whole model in this process, which a parallel engine "
                         "does not keep (only its own shard): drop --tensor-parallel-size / --pipeline-parallel-size")
    requests = make_requests(args.dataset, args.num_prompts, args.input_len, args.output_len,
                             vocab_size=engine.loaded.config.vocab_size, seed=args.dataset_seed,
                             tokenize=lambda text: engine.tokenizer.encode(text))
    warm_up(engine)
    with report.progress_bar("minipaged", len(requests)) as advance:
        result = run_requests(engine, requests, on_progress=advance)
    record: dict[str, Any] = {"bench": "throughput", "model": args.model, "engine_options": engine_options(args),
                              "workload": {**describe(args), "num_prompts": args.num_prompts},
                              "minipaged": rates(result.seconds, len(requests), result.num_input_tokens,
                                                 result.num_output_tokens)}
    print_rates("minipaged", record["minipaged"])
    if args.record:
        save_trace(args.record, engine, result.events)
    if args.baseline == "transformers":
        prompts = [r.prompt_token_ids for r in requests]
        wants = [r.output_len for r in requests]
        hf_padded_generate(engine.loaded.hf_model, prompts[:1], [2], 1)           # its own warm-up
        with report.progress_bar("transformers", len(requests)) as advance:
            seconds, useful = hf_padded_generate(engine.loaded.hf_model, prompts, wants, args.baseline_batch_size,
                                                 on_progress=advance)
        record["transformers"] = {**rates(seconds, len(requests), sum(map(len, prompts)), useful),
                                  "batch_size": args.baseline_batch_size}
        record["ratio_output_tokens_per_s"] = (record["minipaged"]["output_tokens_per_s"]
                                               / record["transformers"]["output_tokens_per_s"])
        print_rates(f"transformers (padded batches of {args.baseline_batch_size})", record["transformers"])
        print(f"ratio minipaged / transformers (output tokens/s): {record['ratio_output_tokens_per_s']:.2f}x")
    report.write_json(args.output_json, record)
    if args.plot:
        plot(record, args.plot)
    return 0


def save_trace(path: str, engine: Any, events: list) -> None:
    from ..trace import write_trace_event, write_trace_header
    try:
        with open(path, "w") as fp:
            write_trace_header(fp, engine.info)
            for event in events:
                write_trace_event(fp, event)
    except OSError as e:
        raise BenchError(f"--record {path}: {e.strerror or e}") from None
    report.err.print(f"[dim]saved {len(events)} steps to {path} (draw them: minipaged plot {path})[/]")


def print_rates(name: str, r: dict[str, Any]) -> None:
    print(f"{name}: {r['num_requests']} requests in {r['seconds']:.2f} s: {r['requests_per_s']:.2f} requests/s, "
          f"{r['output_tokens_per_s']:.1f} output tokens/s, {r['total_tokens_per_s']:.1f} total tokens/s "
          f"({r['input_tokens']} in, {r['output_tokens']} out)")


def plot(record: dict[str, Any], path: str) -> None:
    systems = [name for name in ("minipaged", "transformers") if name in record]
    fig, (ax_tokens, ax_requests) = report.new_figure(2, f"bench throughput: {record['model']}, "
                                                         f"{record['workload']['num_prompts']} requests")
    colours = ["tab:blue", "tab:grey"][:len(systems)]
    ax_tokens.bar(systems, [record[s]["output_tokens_per_s"] for s in systems], color=colours)
    ax_tokens.set_ylabel("output tokens/s")
    ax_requests.bar(systems, [record[s]["requests_per_s"] for s in systems], color=colours)
    ax_requests.set_ylabel("requests/s")
    report.save_figure(fig, path)
