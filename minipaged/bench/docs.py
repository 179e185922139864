"""Render the measured docs from their templates and the JSON the benchmarks wrote.

* ``docs/tuning.md`` from ``docs/tuning.md.in`` and ``docs/tuning.json`` (``bench/tuning.py`` writes it);
* ``docs/performance.md`` from ``docs/performance.md.in``, every ``bench/out/*.json`` (one per benchmark
  script) and the peer comparison (``docs/peer.md.in``, from ``docs/tuning.json`` too).

The numbers in the templates are placeholders (``minipaged.placeholders``, as in the lessons):
``{{throughput.minipaged.seconds:.1f}}`` is a value of ``bench/out/throughput.json``; ``{{tables.NAME}}`` a
table built here from one JSON's rows; ``{{derived.NAME}}`` a ratio of two measured values; ``{{config.NAME}}``
an engine default. Text and numbers therefore cannot drift apart: a test renders the templates again and
compares with what is checked in, and finds any digit typed into a template by hand.

    python bench/render_docs.py          # after editing a template, or after a benchmark wrote its JSON
"""
from __future__ import annotations

import json
import statistics
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable

from .. import placeholders
from .report import BENCH_OUT, markdown_table

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
RESULTS = DOCS / "tuning.json"
TUNING_TEMPLATE, TUNING_DOC = DOCS / "tuning.md.in", DOCS / "tuning.md"
PEER_TEMPLATE = DOCS / "peer.md.in"
PERFORMANCE_TEMPLATE, PERFORMANCE_DOC = DOCS / "performance.md.in", DOCS / "performance.md"
QUANTIZATION_TEMPLATE, QUANTIZATION_DOC = DOCS / "quantization.md.in", DOCS / "quantization.md"
WEB_VIEW_TEMPLATE, WEB_VIEW_DOC = DOCS / "web-view.md.in", DOCS / "web-view.md"
RENDER_COMMAND = "python bench/render_docs.py"
# docs/performance.md's section between these lines is the rendered peer template.
PEER_BEGIN = f"<!-- peer comparison: rendered by {RENDER_COMMAND} from docs/peer.md.in; do not edit by hand -->"
PEER_END = "<!-- end of peer comparison -->"


def generated_note(template: Path, sources: str) -> str:
    return (f"<!-- rendered by {RENDER_COMMAND} from docs/{template.name} and {sources}; edit those and "
            f"re-render -->\n")


def render(template: str, values: dict[str, Any]) -> str:
    """Fill every ``{{key:spec}}`` from ``values``; a key the values lack raises KeyError naming it."""
    try:
        return placeholders.fill(template, values, booleans=("no", "yes"))
    except KeyError as exc:
        raise KeyError(f"{exc.args[0]}; a template uses a value no JSON holds: rerun the benchmark that "
                       f"measures it (bench/*.py), or fix the template") from None


# ------------------------------------------------------------------------------------------- docs/tuning.md

def load_values(path: Path = RESULTS) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))["values"]


def rendered_tuning_doc(values: dict[str, Any]) -> str:
    return (generated_note(TUNING_TEMPLATE, "docs/tuning.json")
            + render(TUNING_TEMPLATE.read_text(encoding="utf-8"), values))


def peer_section(values: dict[str, Any]) -> str:
    return f"{PEER_BEGIN}\n{render(PEER_TEMPLATE.read_text(encoding='utf-8'), values).strip()}\n{PEER_END}"


def with_peer_section(text: str, values: dict[str, Any]) -> str:
    """``text`` with its peer section replaced by a fresh rendering (the markers must be there)."""
    start, end = text.find(PEER_BEGIN), text.find(PEER_END)
    if start < 0 or end < start:
        raise ValueError(f"no peer-comparison markers; put these two lines where the section goes:\n"
                         f"{PEER_BEGIN}\n{PEER_END}")
    return text[:start] + peer_section(values) + text[end + len(PEER_END):]


# -------------------------------------------------------------------------------------- docs/performance.md

def bench_results(folder: Path = BENCH_OUT) -> dict[str, Any]:
    """Every benchmark script's last result, by script name (``bench/out/NAME.json``)."""
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))}


def engine_defaults() -> dict[str, Any]:
    """The engine's defaults as a model with a long context gets them (the derived ones filled in)."""
    from ..config import EngineConfig
    config = EngineConfig()
    config.finalize(model_max_len=1 << 16)
    return {f.name: getattr(config, f.name) for f in fields(EngineConfig)}


def short(value: float) -> str:
    """Three significant digits, without switching to exponents for big values."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def ms(value: float) -> str:
    return f"{short(value)} ms"


def throughput_derived(r: dict[str, Any]) -> dict[str, Any]:
    ours = r["minipaged"]
    return {"ideal_tps": ours["output_tokens"] / r["ideal_matmul_s"],
            "ideal_share": r["ideal_matmul_s"] / ours["seconds"],
            "prompt_share": ours["input_tokens"] / (ours["input_tokens"] + ours["output_tokens"])}


def decode_floor_table(r: dict[str, Any]) -> str:
    rows = []
    for batch, b in r["batches"].items():
        torch_path = (ms(b["torch_path_ms"]), f"{b['torch_path_efficiency']:.2f}") if "torch_path_ms" in b \
            else ("-", "-")
        rows.append([batch, ms(b["engine_ms"]), ms(b["floor_ms"]), f"{b['efficiency']:.2f}",
                     f"{ms(b['torch_best_floor_ms'])} ({ms(b['torch_out_in_floor_ms'])} / "
                     f"{ms(b['torch_in_out_floor_ms'])})", f"{b['efficiency_vs_torch_best']:.2f}",
                     f"{ms(b['kv_read_ms'])} ({b['kv_mib']:.0f} MiB)", f"{b['efficiency_incl_kv_read']:.2f}",
                     *torch_path])
    return markdown_table(["batch", "engine step", "own floor", "vs own floor",
                           "torch's best floor ([out, in] / [in, out])", "vs torch's best", "KV read",
                           "vs torch's best + KV read", "torch-path step", "torch-path vs torch's best"], rows)


def decode_profile_table(r: dict[str, Any]) -> str:
    batches = [(batch, b["profile"]) for batch, b in r["batches"].items() if "profile" in b]
    parts = list(dict.fromkeys(part for _, p in batches for part in p["ms"]))
    rows = [[batch, ms(p["step_ms"]), *(ms(p["ms"].get(part, 0.0)) for part in parts), f"{p['ops_per_layer']:.1f}"]
            for batch, p in batches]
    return markdown_table(["batch", "profiled step", *parts, "operators per layer"], rows)


def spec_decode_table(r: dict[str, Any]) -> str:
    rows = []

    def cpu(x: dict[str, Any], key: str, form: str) -> str:       # (records before the CPU-time columns: -)
        return "-" if x.get(key) is None else format(x[key], form)
    for x in r["results"]:
        accepted = "-" if x["acceptance_rate"] is None else f"{x['acceptance_rate']:.0%}"
        rows.append([x["workload"], x["batch"], x["config"], accepted, f"{x['tokens_per_forward']:.2f}",
                     f"{x['output_tokens'] / x['wall_s']:.1f}", f"{x['speedup']:.2f}x",
                     cpu(x, "cpu_speedup", ".2f") + ("x" if x.get("cpu_speedup") else ""),
                     cpu(x, "verify_vs_decode", ".2f") + ("x" if x.get("verify_vs_decode") else ""),
                     cpu(x, "draft_ms_per_step", ".2f"), cpu(x, "host_ms_per_step", ".2f"),
                     "yes" if x["identical"] else "**no**"])
    return markdown_table(["workload", "batch", "speculation", "drafts accepted", "tokens / target forward",
                           "output tok/s", "speed-up", "CPU speed-up", "verify step / decode step",
                           "drafting ms / step", "host ms / step", "same greedy tokens"], rows)


def load_of(x: dict[str, Any]) -> str:
    """How an --under-load row fed its requests (runs before the steady rows had one batch only)."""
    if x.get("load", "one batch") == "one batch":
        return "one batch"
    return f"steady, {x['prompts']} prompts"


def spec_decode_load_table(r: dict[str, Any]) -> str:
    """bench/spec_decode.py --under-load: the median CPU speed-up over the rounds, and its range; for an automatic
    k also over the same engine with its speculator out."""
    def itself(x: dict[str, Any]) -> str:
        if "cpu_speedup_itself" not in x:
            return "-"
        return (f"{x['cpu_speedup_itself']:.3f}x ({x['cpu_speedup_itself_min']:.3f}-"
                f"{x['cpu_speedup_itself_max']:.3f})")
    rows = [[x["workload"], x["batch"], load_of(x), x["config"], f"{x['tokens_per_forward']:.2f}",
             f"{x['cpu_speedup']:.3f}x ({x['cpu_speedup_min']:.3f}-{x['cpu_speedup_max']:.3f})", itself(x),
             f"{x['speedup']:.2f}x", f"{x['draft_ms_per_step']:.2f}", f"{x['host_ms_per_step']:.2f}",
             "yes" if x["identical"] and x.get("identical_itself", True) else "**no**"]
            for x in r["results"]]
    return markdown_table(["workload", "requests", "load", "speculation", "tokens / target forward",
                           "CPU speed-up over the off engines: median (range)",
                           "CPU speed-up over itself, speculator out", "wall speed-up (median)",
                           "drafting ms / step", "host ms / step", "same greedy tokens"], rows)


def chunked_prefill_table(r: dict[str, Any]) -> str:
    rows = [[x["budget"] if x["budget"] != "chunked off" else "chunked off (prefill-first)",
             f"{short(x['itl_p99_ms'] / 1000)} s", f"{short(x['ttft_long_s'])} s", x["ttft_long_steps"],
             f"{short(x['throughput_tok_s'])} tok/s"] for x in r["results"]]
    return markdown_table(["max_num_batched_tokens", "decoders' ITL p99", "long prompts' TTFT", "TTFT in steps",
                           "throughput"], rows)


def chunked_prefill_derived(r: dict[str, Any], default_budget: int) -> dict[str, Any]:
    """The smallest budget's p99 ITL against the default budget's (or the largest measured, if the run left
    the default out)."""
    by_budget = {x["budget"]: x for x in r["results"] if isinstance(x["budget"], int)}
    smallest = min(by_budget)
    compared = default_budget if default_budget in by_budget else max(by_budget)
    return {"smallest_budget": smallest, "compared_budget": compared,
            "itl_p99_gain": by_budget[compared]["itl_p99_ms"] / by_budget[smallest]["itl_p99_ms"]}


def long_prefill_table(r: dict[str, Any]) -> str:
    """bench/long_prefill.py: the short request and the long one per threshold (engine-thread CPU seconds)."""
    rows = [["0 (off)" if x["long_prefill_token_threshold"] == 0 else x["long_prefill_token_threshold"],
             f"{x['victim_ttft_cpu_s']:.2f} s", f"{x['victim_max_gap_cpu_s']:.2f} s", f"{x['victim_done_cpu_s']:.1f} s",
             f"{x['long_all_first_tokens_cpu_s']:.1f} s", x["steps"], "yes" if x["same_tokens"] else "**no**"]
            for x in r["results"]]
    return markdown_table(["long_prefill_token_threshold", "short: first token", "short: longest pause",
                           "short: done", "long: every sample's first token", "steps", "same tokens"], rows)


def long_prefill_derived(r: dict[str, Any], default_threshold: int) -> dict[str, Any]:
    """The row without a cap (the scheduler before issue 39) and the default's row."""
    by_threshold = {x["long_prefill_token_threshold"]: x for x in r["results"]}
    if 0 not in by_threshold or default_threshold not in by_threshold:
        raise KeyError(f"bench/out/long_prefill.json needs rows for 0 and the default {default_threshold}: rerun "
                       f"bench/long_prefill.py with --thresholds including both")
    return {"before": by_threshold[0], "default": by_threshold[default_threshold]}


def serve_cpu_shares(r: dict[str, Any]) -> dict[str, float]:
    """bench/serve.py's CPU per token over in-process, by process (the medians over the rounds): the engine
    core's, the API server's, and the clients'."""
    return {"core_cpu": statistics.median(r["core_cpu_over_in_process"]),
            "api_cpu": statistics.median(r["api_server_cpu_over_in_process"]),
            "clients_cpu": statistics.median(r["clients_cpu_over_in_process"]),
            "one_over_two": 1 / statistics.median(r["two_processes_over_one"])}


def core_isolation_table(r: dict[str, Any]) -> str:
    """bench/core_isolation.py: what an adversary did, the core's longest gap between steps, the victim's pause."""
    return markdown_table(["what a client did", "for", "the core's longest gap between steps",
                           "the victim's longest pause"],
                          [[x["case"], f"{x['seconds']:.2f} s", f"{x['core_longest_gap_s'] * 1000:.0f} ms",
                            f"{x['victim_longest_pause_s'] * 1000:.0f} ms"] for x in r["rows"]])


def fair_share_table(r: dict[str, Any]) -> str:
    """bench/fair_share.py: each case with fair share off and on (seconds of the engine thread's CPU time)."""
    rows = [[x["case"], "on" if x["fair_share"] else "off", f"{x['victim_max_gap_cpu_s']:.2f} s",
             f"{x['victim_done_cpu_s']:.2f} s", f"{x['greedy_done_cpu_s']:.2f} s", x["steps_after_flood"],
             f"{x['preemptions']} ({x['victim_preemptions']})", "yes" if x["same_tokens"] else "**no**"]
            for x in r["results"]]
    return markdown_table(["case", "fair share", "victim: longest pause", "victim: done", "greedy client: done",
                           "steps", "preemptions (the victim's)", "same tokens"], rows)


def soak_table(r: dict[str, Any]) -> str:
    """bench/soak.py: each adversary's row against issue 48's targets (a figure past its target in bold)."""
    targets = r["targets"]

    def against(value: float, target: float) -> str:
        return f"{value:.2f} s" if value <= target else f"**{value:.2f} s**"

    def seconds_figure(seconds: float) -> str:          # a row refused at once lasts a tenth of a second
        return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2f} s"

    def first_token(x: dict[str, Any]) -> str:          # (runs before it was recorded have none)
        value = x.get("students_slowest_first_token_s")
        return "-" if value is None or value != value else f"{value:.2f} s"

    def rss(x: dict[str, Any]) -> str:
        text = f"{x['rss_before_mb']:.0f} -> {x['rss_after_mb']:.0f}"
        return text if x["rss_after_mb"] - x["rss_before_mb"] <= targets["rss_growth_mb"] else f"**{text}**"
    rows = [[x["row"], seconds_figure(x['seconds']), against(x["victim_longest_pause_s"], targets["victim_pause_s"]),
             against(x["health_slowest_s"], targets["health_s"]), first_token(x),
             x["adversary_codes"] + (f"; {x['notes']}" if x["notes"] else ""), x.get("student_codes", "-"), rss(x)]
            for x in r["rows"]]
    return markdown_table(["what the adversary did", "for", "victim's longest pause", "/health's slowest answer",
                           "students' slowest first token", "adversary's answers", "students' answers",
                           "server RSS MB before -> after"], rows)


def preemption_table(r: dict[str, Any]) -> str:
    rows = [["big pool (no preemption)" if x["mode"].startswith("none") else x["mode"],
             f"{short(x['throughput_tok_s'])} tok/s", x["preemptions"], x["extra_prefill_tokens"], x["blocks_copied"],
             x["steps"]] for x in r["results"]]
    return markdown_table(["mode", "throughput", "preemptions", "extra prefill tokens", "blocks copied", "steps"],
                          rows)


def parallel_table(r: dict[str, Any]) -> str:
    rows = [[x["layout"], x["ranks"], x["kv_blocks_per_rank"], short(x["step_ms"]), short(x["comm_ms_per_step"]),
             f"{x['comm_share']:.0%}", f"{x['tok_s']:.0f}", "yes" if x["same_outputs_as_first"] else "**no**"]
            for x in r["results"]]
    return markdown_table(["layout", "ranks", "KV blocks per rank", "step ms", "comm ms/step", "comm share",
                           "tok/s", "same tokens"], rows)


def web_watchers_table(r: dict[str, Any]) -> str:
    """bench/web_watchers.py's phases: throughput, the server's peak memory, watchers that got every step."""
    phases, rows = r["phases"], []
    for key, label in (("none", "no watchers"), ("watchers", "{watchers} event-stream watchers"),
                       ("none_again", "no watchers (again)"),
                       ("watchers_and_pages", "{watchers} watchers + {pages} Chromium pages (same cores)")):
        if key not in phases:
            continue
        p = phases[key]
        num_pages = r.get("pages", len(p.get("pages", [])))
        got = "-" if key.startswith("none") else f"{p['watchers_complete']}/{p['watchers']}"
        if key == "watchers_and_pages":
            got += f", pages {p['pages_complete']}/{num_pages}"
        rows.append([label.format(watchers=p["watchers"], pages=num_pages), f"{p['tok_s']:.1f}",
                     f"{p['peak_rss_mb']:.0f}", got])
    return markdown_table(["phase", "output tok/s", "server peak RSS MB", "watchers that got every step"], rows)


def peer_llamacpp_table(record: dict[str, Any]) -> str:
    """bench/peer_llamacpp.py's servers: one request alone, and ``in_flight`` requests in flight."""
    rows, in_flight = [], record["in_flight"]
    for name, r in record["results"].items():
        alone, loaded = r["alone"], r["loaded"]
        own = alone.get("own_decode_ms")
        rows.append([name, f"{alone['output_tok_s']:.1f}", f"{alone['median_tpot_ms']:.2f}",
                     "-" if own is None else f"{own:.2f}", f"{alone['median_ttft_s'] * 1000:.0f}",
                     f"{loaded['output_tok_s']:.1f}", f"{loaded['median_ttft_s']:.2f}"])
    return markdown_table(["server", "alone: out tok/s", "alone: ms per token", "(llama.cpp's own count)",
                           "alone: TTFT ms", f"{in_flight} in flight: out tok/s",
                           f"{in_flight} in flight: median TTFT s"], rows)


def fleet_table(r: dict[str, Any]) -> str:
    """bench/fleet.py's runs: the fleet's prefix-cache hit rate per policy and fleet size, and what the client saw."""
    rows = [[x["replicas"], x["policy"], f"{x['hit_rate']:.1%}", ms(1000 * x["ttft_p50_s"]), ms(1000 * x["ttft_p99_s"]),
             f"{x['output_tokens_per_s']:.0f}", " / ".join(map(str, x["served_per_replica"]))] for x in r["runs"]]
    return markdown_table(["replicas", "router policy", "prefix-cache hit rate", "TTFT p50", "TTFT p99",
                           "output tok/s", "requests per replica"], rows)


# bench/spec_verify_cost.py's parts, in words
KERNEL_LABELS = {"matmuls": "matmuls ({layers} layers)", "lm_head": "LM head",
                 "attention": "attention ({layers} layers)", "layer_ops": "layer ops ({layers} layers)",
                 "layer_loop": "the layer loop, one compiled call",
                 "forward": "forward pass (embedding, loop, final norm, LM head)"}
STEP_LABELS = {"step": "whole step", "schedule": "scheduling", "prepare": "preparing the inputs",
               "forward": "forward pass", "layer_loop": "- the layer loop", "lm_head": "- the LM head",
               "attention_plan": "- the attention plan", "argmax": "argmax of the rows",
               "sample": "sampler (rows without drafts)", "rejection_sampler": "rejection sampler",
               "proposer": "proposer (n-gram lookup)", "update": "scheduler's update (appending tokens)",
               "outputs": "output processor (text, deltas)", "event": "the step's event"}


def spec_verify_cost_table(record: dict[str, Any]) -> str:
    """bench/spec_verify_cost.py's two tables: a verify step's kernels and step parts beside a decode step's."""
    args, rows = record["args"], record["rows"]
    kernels, steps = record["kernels_ms"], record["steps_ms"]
    # (no column of differences: when both values move, their difference can stay put, and the docs' test
    # would take it for a number typed by hand)
    kernel_rows = [[KERNEL_LABELS[name].format(layers=record["num_layers"]), f"{t['decode']:.2f}",
                    f"{t['verify']:.2f}", f"{t['verify'] / t['decode']:.2f}x"] for name, t in kernels.items()]
    step_rows = [[STEP_LABELS[name], f"{t['decode']:.3f}", f"{t['verify']:.3f}"] for name, t in steps.items()]
    return (f"Kernels, one request at {args['context']} tokens of context, {args['repeats']} interleaved "
            "repetitions:\n\n" + markdown_table(["part", "1 row", f"{rows} rows", "ratio"], kernel_rows)
            + f"\n\nEngine steps, {args['prompts']} input-grounded prompts at batch one, {args['max_tokens']} new "
            f"tokens: medians over the {record['num_steps']['decode']} decode steps of the run without speculation "
            f"and the {record['num_steps']['verify']} verify steps of the n-gram run (each part's median taken on its "
            "own: the parts need not add up to the step):\n\n"
            + markdown_table(["part", "decode step", "verify step"], step_rows))


def one_request_table(r: dict[str, Any]) -> str:
    """bench/one_request.py: each tree's best and median speed and its best over the working tree's, in-process
    and, where the run measured it, through ``serve`` (with serve's best over the same tree's in-process best:
    what the server's process boundary, tokenising and streaming cost one request)."""
    serve = any("serve" in t for t in r["trees"].values())
    in_process = any("best" in t for t in r["trees"].values())        # (a --paths serve run has none)
    headers = ["tree", "commit"]
    if in_process:
        headers += ["in-process best tok/s", "median", "best / working tree's"]
    if serve:
        headers += ["serve best tok/s", "median", "best / working tree's"]
    if serve and in_process:
        headers += ["serve / in-process"]
    rows = []
    for name, t in r["trees"].items():
        row = [name, t["commit"]]
        if in_process:
            row += [t.get("best", "–"), t.get("median", "–"), t.get("best_over_working_tree", "–")]
        s = t.get("serve", {})
        if serve:
            row += [s.get("best", "–"), s.get("median", "–"), s.get("best_over_working_tree", "–")]
        if serve and in_process:
            row += [t.get("serve_over_in_process", "–")]
        rows.append(row)
    load = (f"\n\nThe machine's load average (1 minute) before each run: {r['load_average'][0]:.1f} to "
            f"{r['load_average'][1]:.1f} on {r['cores']} cores." if "load_average" in r else "")
    return markdown_table(headers, rows, ".2f") + load


def one_request_profile_table(r: dict[str, Any]) -> str:
    """bench/one_request_profile.py: one request's decode step by part in-process, and a token's wall and CPU
    time through serve (each process's CPU: the engine core's and the API server's)."""
    ms, share, serve = r["in_process"]["cpu_ms_per_step"], r["in_process"]["share"], r["serve"]
    rows = [("compiled layer loop (one C call for every layer)", ms["layers"], f"{share['layers']:.0%}"),
            ("LM head", ms["lm_head"], f"{share['lm_head']:.0%}"),
            ("rest of the forward pass", ms["forward_rest"], f"{share['forward_rest']:.1%}"),
            ("host: the step less the model", ms["host"], f"{share['host']:.1%}"),
            ("in-process step", ms["step"], f"{share['step']:.0%}"),
            ("in-process step, wall time", r["in_process"]["ms_per_step"]["step"], "–"),
            ("through serve: wall time per token", serve["wall_ms"], "–"),
            ("through serve: engine core's CPU per token", serve["core_cpu_ms"], "–"),
            ("through serve: API server's CPU per token", serve["api_cpu_ms"], "–")]
    return markdown_table(["one request, per decode step (CPU time unless said)", "ms",
                           "share of the in-process step"], rows, ".2f")


def notebook_widget_table(r: dict[str, Any]) -> str:
    """bench/notebook_widget.py's lessons: throughput without and with the widget, its cost, the feed's own work."""
    rows = [[number, str(v["steps"]), f"{v['tok_s_without']:.1f}", f"{v['tok_s_with']:.1f}", f"{v['cost']:+.1%}",
             f"{v['messages_per_run']:.0f}", f"{v['feed_us_per_step']:.0f}", f"{v['median_step_ms']:.2f}"]
            for number, v in r["lessons"].items()]
    return markdown_table(["lesson", "steps a run", "tok/s without", "tok/s with the widget", "cost",
                           "messages a run", "feed µs a step", "median step ms"], rows)


TABLES: dict[str, Callable[[dict[str, Any]], str]] = {
    "notebook_widget": notebook_widget_table, "notebook_widget_smollm2": notebook_widget_table,
    "decode_floor": decode_floor_table, "decode_profile": decode_profile_table, "spec_decode": spec_decode_table,
    "spec_decode_load": spec_decode_load_table,
    "chunked_prefill": chunked_prefill_table, "preemption": preemption_table, "parallel": parallel_table,
    "web_watchers": web_watchers_table, "peer_llamacpp": peer_llamacpp_table, "fleet": fleet_table,
    "fleet_smollm2": fleet_table,
    "long_prefill": long_prefill_table, "fair_share": fair_share_table, "core_isolation_tiny": core_isolation_table,
    "soak_tiny": soak_table, "soak": soak_table,
    **{f"soak_{case}": soak_table for case in ("slowloris_before", "slowloris_after", "logprobs_before",
                                               "logprobs_after", "logprobs_bound",
                                               "watchers_before", "watchers_after")},
    "spec_verify_cost": spec_verify_cost_table, "one_request": one_request_table,
    "one_request_profile": one_request_profile_table}
SOURCES = {"decode_profile": "decode_floor"}          # a table built from another script's JSON


def quantization_derived(r: dict[str, Any]) -> dict[str, Any]:
    agreement, ppl = r["agreement"], r["perplexity"]
    return {"teacher_forced_percent": 100 * agreement["teacher_forced"],
            "prefix_percent": 100 * agreement["prefix_agreement"],
            "perplexity_change_percent": 100 * ppl["relative_change"],
            "weights_ratio": r["weights_mib"]["fp32"] / r["weights_mib"]["int8"]}


def one_request_profile_derived(r: dict[str, Any]) -> dict[str, Any]:
    """What serving one request adds to its step, in CPU time per token: both processes' CPU through serve less
    the in-process step's (wall time on a busy machine measures the other jobs too)."""
    step = r["in_process"]["cpu_ms_per_step"]["step"]
    serve = r["serve"]["core_cpu_ms"] + r["serve"]["api_cpu_ms"]
    return {"serve_extra_cpu_ms": serve - step, "serve_cpu_over_in_process": serve / step}


def performance_values(results: dict[str, Any], tuning_values: dict[str, Any]) -> dict[str, Any]:
    """What docs/performance.md.in may name: every bench/out JSON by script name, and the tables, derived
    ratios, engine defaults and the peer section built from them."""
    config = engine_defaults()
    return {**results, "config": config,
            "tables": {name: build(results[SOURCES.get(name, name)]) for name, build in TABLES.items()},
            "derived": {"throughput": throughput_derived(results["throughput"]),
                        "chunked_prefill": chunked_prefill_derived(results["chunked_prefill"],
                                                                   config["max_num_batched_tokens"]),
                        "long_prefill": long_prefill_derived(results["long_prefill"],
                                                             config["long_prefill_token_threshold"]),
                        "quantization": quantization_derived(results["quantization"]),
                        "web_watchers_extra_rss_mb": web_watchers_extra_rss_mb(results["web_watchers"]),
                        "serve_tiny": serve_cpu_shares(results["serve_tiny"]),
                        "peer": peer_derived(results["peer_llamacpp"]),
                        "one_request_profile": one_request_profile_derived(results["one_request_profile"])},
            "peer_section": peer_section(tuning_values)}


def rendered_performance_doc(results: dict[str, Any], tuning_values: dict[str, Any]) -> str:
    return (generated_note(PERFORMANCE_TEMPLATE, "bench/out/*.json (and docs/tuning.json for the peer section)")
            + render(PERFORMANCE_TEMPLATE.read_text(encoding="utf-8"), performance_values(results, tuning_values)))


def peer_derived(record: dict[str, Any]) -> dict[str, Any]:
    """From bench/peer_llamacpp.py's record: each alone target's lowest and highest ratio over the rounds, and
    the ms per token alone of minipaged int8 against llama.cpp Q8_0 (the decode alone, without the prefill)."""
    rounds = record.get("ratios_each_round") or [record["ratios"]]
    spread = {key: {"low": min(r[key] for r in rounds), "high": max(r[key] for r in rounds)}
              for key in ("alone_fp32_vs_f32", "alone_int8_vs_q8_0") if all(key in r for r in rounds)}
    results = record["results"]
    int8, q8 = results["minipaged-int8"]["alone"], results["llama.cpp-Q8_0"]["alone"]
    return {"rounds": len(rounds), "spread": spread,
            "fp32_tpot_ms": results["minipaged-fp32"]["alone"]["median_tpot_ms"],
            "int8_tpot_ms": int8["median_tpot_ms"], "q8_0_tpot_ms": q8["median_tpot_ms"],
            "int8_decode_vs_q8_0": q8["median_tpot_ms"] / int8["median_tpot_ms"],
            "int8_ttft_ms": int8["median_ttft_s"] * 1000, "q8_0_ttft_ms": q8["median_ttft_s"] * 1000}


def rendered_quantization_doc(results: dict[str, Any]) -> str:
    """docs/quantization.md from its template and bench/out/ (quantization, peer_llamacpp, decode_floor)."""
    floor, peer = results["decode_floor"]["batches"]["1"], results["peer_llamacpp"]["results"]
    derived = {"quantization": quantization_derived(results["quantization"]),
               "above_floor_ms": floor["engine_ms"] - floor["floor_ms"],
               "llama_f32_own_ms": peer["llama.cpp-F32"]["alone"]["own_decode_ms"],
               "peer": peer_derived(results["peer_llamacpp"])}
    values = {**results, "derived": derived,
              "tables": {"peer_llamacpp": peer_llamacpp_table(results["peer_llamacpp"])}}
    return (generated_note(QUANTIZATION_TEMPLATE, "bench/out/quantization.json, peer_llamacpp.json, decode_floor.json")
            + render(QUANTIZATION_TEMPLATE.read_text(encoding="utf-8"), values))


def web_watchers_extra_rss_mb(r: dict[str, Any]) -> float:
    """The server's peak memory with the watchers above the lower of its no-watcher peaks (the first phase
    may still grow the allocator's pools, which would make the difference negative)."""
    p = r["phases"]
    return p["watchers"]["peak_rss_mb"] - min(p["none"]["peak_rss_mb"], p["none_again"]["peak_rss_mb"])


def rendered_web_view_doc(results: dict[str, Any]) -> str:
    r = dict(results["web_watchers"])
    r["pages_count"] = r.get("pages", len(r["phases"].get("watchers_and_pages", {}).get("pages", [])))
    r["extra_rss_mb"] = web_watchers_extra_rss_mb(r)
    return (generated_note(WEB_VIEW_TEMPLATE, "bench/out/web_watchers.json")
            + render(WEB_VIEW_TEMPLATE.read_text(encoding="utf-8"),
                     {"web_watchers": r, "tables": {"web_watchers": web_watchers_table(r)}}))


def write_all(values: dict[str, Any] | None = None) -> None:
    """Render both docs (``values``: docs/tuning.json's, when a caller has them at hand)."""
    values = load_values() if values is None else values
    TUNING_DOC.write_text(rendered_tuning_doc(values), encoding="utf-8")
    results = bench_results()
    PERFORMANCE_DOC.write_text(rendered_performance_doc(results, values), encoding="utf-8")
    WEB_VIEW_DOC.write_text(rendered_web_view_doc(results), encoding="utf-8")
    QUANTIZATION_DOC.write_text(rendered_quantization_doc(results), encoding="utf-8")
    print(f"wrote {TUNING_DOC.relative_to(ROOT)}, {PERFORMANCE_DOC.relative_to(ROOT)}, "
          f"{WEB_VIEW_DOC.relative_to(ROOT)} and {QUANTIZATION_DOC.relative_to(ROOT)}")
