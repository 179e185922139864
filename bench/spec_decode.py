"""Speculative decoding on the embedded SmolLM2: off vs n-gram vs draft models (the first layers, the int8
self-draft) vs the automatic k, at batch 1, 4, 16 and 64.

Two workloads, as the seed guide's "When to use" suggests comparing:
  * input-grounded: the answer quotes its input (repeat / correct / edit a passage), where prompt lookup
    finds long matches;
  * open-ended: questions whose answers the prompt does not contain.

For each configuration it reports, in one run: acceptance rate (accepted / drafted), mean acceptance
length (tokens per verification: accepted + the target's own), tokens per target forward pass (all
generated tokens / request-forwards that produced tokens), wall time and the speed-up over speculation
off, and whether greedy outputs were identical (they must be).

Beside the wall clock (which other jobs on a shared machine disturb) it counts the engine thread's CPU time
(``time.thread_time``; one torch thread by default, so that every kernel runs on that thread and the count is
the whole of the work): the CPU speed-up over speculation off; a verification step's forward pass relative to
a plain decode step's (the median of each: a step that verifies drafts, beside a step of the same batch with
none, in the "off" run); and per step the drafting time (the proposer: a draft model's forward passes) and the
host time (everything in a step but the target's forward pass and the drafting: scheduling, the rejection
sampler, bookkeeping, detokenizing).

Under load (``--under-load``: 16 and 64 requests) a speed-up is a few percent either way, the size of the
noise between two runs of one engine: that mode runs each batch several rounds, every engine in turn in each
round, beside a second engine with speculation off (the two "off" engines, averaged, are each round's baseline;
each one's own "speed-up" over it shows the noise), and reports the median CPU speed-up over the rounds and its
range (bench/out/spec_decode_load.json). Two kinds of load: "one batch", N prompts given to ``generate`` at once
(offline inference: the run ends when its last request does), and "steady", N requests kept in flight as N
clients of a server would (a new one the step after one ends; ``--steady-prompts`` times N prompts in all).

    python bench/spec_decode.py [--model smollm2] [--max-tokens 96] [--batches 1 4 16 64] [--ngram-k 3 5]
                                [--threads 1] [--quick] [--under-load [--rounds 3] [--steady-prompts 2]]
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Optional

from minipaged.bench.docs import spec_decode_load_table
from minipaged.bench.report import BENCH_OUT as OUT
from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
import torch

from minipaged import Engine, SamplingParams
from minipaged.workloads import INSTRUCTIONS, OPEN_ENDED, PASSAGES

def workloads(engine: Engine) -> dict[str, list[str]]:
    grounded = [INSTRUCTIONS[i % 2].format(PASSAGES[i % len(PASSAGES)]) for i in range(16)]
    chat = engine.inputs.chat_prompt
    return {"input-grounded": [chat([{"role": "user", "content": p}]) for p in grounded],
            "open-ended": [chat([{"role": "user", "content": p}]) for p in OPEN_ENDED]}


class CpuClock:
    """The engine thread's CPU time in each step, in its target forward pass and in its drafting, by kind of step:
    'verify' (some request checks drafts), 'decode' (decodes, no drafts) or 'prefill' (a prompt chunk in it)."""

    def __init__(self, engine: Engine) -> None:
        self.steps: list[tuple[str, float, float, float]] = []     # (kind, step, forward, drafting) seconds
        self._forward = self._drafting = 0.0
        self.engine, self._step, self._execute = engine, engine.step, engine.runner.execute
        engine.step, engine.runner.execute = self.step, self.execute
        if engine.speculator is not None:
            self._propose = engine.speculator.propose
            engine.speculator.propose = self.propose

    def _timed(self, call, *args, **kwargs):
        begin = time.thread_time()
        return call(*args, **kwargs), time.thread_time() - begin

    def execute(self, *args, **kwargs):
        out, seconds = self._timed(self._execute, *args, **kwargs)
        self._forward += seconds
        return out

    def propose(self, *args, **kwargs):
        out, seconds = self._timed(self._propose, *args, **kwargs)
        self._drafting += seconds
        return out

    def step(self):
        self._forward = self._drafting = 0.0
        result, seconds = self._timed(self._step)
        scheduled = result.event.scheduled
        kind = ("prefill" if any(s.kind == "prefill" for s in scheduled)
                else "verify" if any(s.draft_token_ids for s in scheduled) else "decode")
        self.steps.append((kind, seconds, self._forward, self._drafting))
        return result

    def median_forward(self, kind: str) -> Optional[float]:
        times = sorted(forward for k, _step, forward, _draft in self.steps if k == kind)
        return times[len(times) // 2] if times else None


def configurations(args: argparse.Namespace) -> dict[str, Optional[dict]]:
    """Every configuration by its name in the tables: speculative_config, or None for speculation off."""
    ngram = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    configs: dict[str, Optional[dict]] = {"off": None}
    for k in args.ngram_k:
        configs[f"ngram k={k}"] = {**ngram, "num_speculative_tokens": k}
    configs[f"ngram auto k<={max(args.ngram_k)}"] = {**ngram, "num_speculative_tokens": max(args.ngram_k),
                                                    "auto_k": True}
    if args.draft_layers:
        configs[f"self-draft {args.draft_layers}L k={args.k}"] = {
            "method": "draft_model", "model": "self", "num_draft_layers": args.draft_layers,
            "num_speculative_tokens": args.k}
    configs[f"int8 self-draft k={args.k}"] = {"method": "int8_self_draft", "num_speculative_tokens": args.k}
    configs[f"int8 self-draft auto k<={args.k}"] = {"method": "int8_self_draft", "num_speculative_tokens": args.k,
                                                    "auto_k": True}
    return configs


def warmed_engines(model: str, configs: dict[str, Optional[dict]]) -> dict[str, Engine]:
    """An engine per configuration, each run once on a short prompt first (not measured)."""
    engines = {name: Engine(model, speculative_config=spec) for name, spec in configs.items()}
    for engine in engines.values():
        engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    return engines


def in_flight(engine: Engine, prompts: list[str], concurrency: int, params: SamplingParams) -> list:
    """Every prompt, ``concurrency`` requests in flight at a time, as that many clients of a server keep them: a
    new one is added the step after one ends. The outputs in the prompts' order."""
    waiting, ids, outs = list(enumerate(prompts)), {}, {}
    try:
        while waiting or len(outs) < len(ids):
            while waiting and len(ids) - len(outs) < concurrency:
                index, prompt = waiting.pop(0)
                ids[engine.add_request(prompt, params)] = index
            for delta in engine.step().outputs:
                if delta.finished and delta.request_id in ids:
                    outs[ids[delta.request_id]] = delta.output
    except BaseException:
        for rid, index in ids.items():       # interrupted: the engine is left clean, as generate() leaves it
            if index not in outs:
                engine.abort(rid)
        raise
    return [outs[i] for i in range(len(prompts))]


def run(engine: Engine, prompts: list[str], batch: int, params: SamplingParams, steady: bool = False) -> dict:
    """Generate every prompt, ``batch`` at a time (steady: ``batch`` in flight); the engine's counters say what
    speculation did."""
    gc.collect()        # the garbage of the run before, collected now: not in the middle of this run's steps
    events = []
    unsubscribe = engine.subscribe(events.append)
    before = dict(engine.counters)
    clock = CpuClock(engine)
    start = time.perf_counter()
    try:
        if steady:
            outs = in_flight(engine, prompts, batch, params)
        else:
            outs = [out for i in range(0, len(prompts), batch)
                    for out in engine.generate(prompts[i:i + batch], params, use_tqdm=False)]
    finally:
        wall = time.perf_counter() - start
        unsubscribe()
        del engine.step, engine.runner.execute           # the instance's own methods again
        if engine.speculator is not None:
            del engine.speculator.propose
    after = engine.counters
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    verifications = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    produced = sum(len(t) for e in events for t in e.new_token_ids.values())
    forwards = sum(len(e.new_token_ids) for e in events)
    offered: list[int] = []                # per draft position: how often a draft was there, and accepted
    kept: list[int] = []
    for s in (s for e in events for s in e.scheduled if s.draft_token_ids):
        for i in range(len(s.draft_token_ids)):
            if i == len(offered):
                offered.append(0)
                kept.append(0)
            offered[i] += 1
            kept[i] += i < s.num_accepted
    steps = clock.steps
    cpu = sum(step for _k, step, _f, _d in steps)
    drafting = sum(d for _k, _s, _f, d in steps)
    host = cpu - sum(f for _k, _s, f, _d in steps) - drafting
    return {"wall_s": wall, "tokens": [o.token_ids for o in outs], "output_tokens": produced,
            "acceptance_by_position": [round(k / o, 4) for k, o in zip(kept, offered)],
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / verifications if verifications else None,
            "tokens_per_forward": produced / forwards if forwards else 0.0, "steps": len(events),
            "cpu_s": cpu, "host_ms_per_step": 1000 * host / len(steps), "draft_ms_per_step": 1000 * drafting / len(steps),
            "verify_forward_ms": ms(clock.median_forward("verify")),
            "decode_forward_ms": ms(clock.median_forward("decode")),
            "verify_steps": sum(1 for k, *_ in steps if k == "verify")}


def ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else round(1000 * seconds, 3)


def early_exit_agreement(engine: Engine, prompts: list[str], layers: int, max_tokens: int) -> float:
    """How often the target's first ``layers`` layers + final norm + LM head pick the full model's next token,
    on the model's own greedy outputs (transformers' forward pass with all hidden states)."""
    import torch
    hf = engine.loaded.hf_model
    agree = total = 0
    for out in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False):
        ids = torch.tensor([out.prompt_token_ids + out.token_ids])
        with torch.inference_mode():
            result = hf(ids, output_hidden_states=True)
        start = len(out.prompt_token_ids) - 1
        full = result.logits[0, start:-1].argmax(-1)
        early = hf.lm_head(hf.model.norm(result.hidden_states[layers][0, start:-1])).argmax(-1)
        agree += int((early == full).sum())
        total += len(full)
    return agree / total


def config_key(name: str) -> str:
    """A configuration's name as a key: 'ngram k=3' -> ngram_k3, 'ngram auto k<=5' -> ngram_auto,
    'self-draft 8L k=3' -> selfdraft, 'int8 self-draft k=3' -> int8draft_k3, '... auto k<=3' -> int8draft_auto."""
    if name.startswith("self-draft"):
        return "selfdraft"
    head = "int8draft" if name.startswith("int8") else "ngram"
    return f"{head}_auto" if " auto " in name else f"{head}_k{name.rsplit('=', 1)[1]}"


def lesson_values(results: list[dict], draft_layers: int, agreement: float) -> dict:
    """The numbers lesson 6 quotes, keyed like ``grounded_b1_ngram_k3_speedup``."""
    values: dict[str, object] = {f"batch_{r['batch']}": r["batch"] for r in results}   # the text's labels
    values.update({"small_batch": min(r["batch"] for r in results), "large_batch": max(r["batch"] for r in results),
                   "selfdraft_layers": draft_layers, "selfdraft_agreement": round(agreement, 4),
                   "ngram_k_long": max(int(r["config"].split("=")[1]) for r in results
                                       if r["config"].startswith("ngram"))})
    for r in results:
        if r["config"] == "off":
            continue
        workload = "grounded" if r["workload"] == "input-grounded" else "open"
        key = f"{workload}_b{r['batch']}_{config_key(r['config'])}"
        values[f"{key}_speedup"] = round(r["speedup"], 2)
        values[f"{key}_cpu_speedup"] = round(r["cpu_speedup"], 2)
        if r.get("verify_vs_decode"):
            values[f"{key}_verify_vs_decode"] = round(r["verify_vs_decode"], 2)
        values[f"{key}_acceptance"] = round(r["acceptance_rate"] or 0.0, 4)
        values[f"{key}_tokens_per_forward"] = round(r["tokens_per_forward"], 2)
        for i, share in enumerate(r.get("acceptance_by_position", [])):
            values[f"{key}_acceptance_pos{i + 1}"] = share
    return values


def write_lesson_values(record: dict, model: str) -> None:
    """Lesson 6's model-dependent numbers into lessons/measured_smollm2.json (other lessons' entries stay)."""
    engine = Engine(model, num_blocks=256)
    prompts = workloads(engine)["open-ended"][:4]
    layers = record["args"]["draft_layers"]
    agreement = early_exit_agreement(engine, prompts, layers, 64)
    path = Path(__file__).resolve().parent.parent / "lessons" / "measured_smollm2.json"
    values = {"6": {**lesson_values(record["results"], layers, agreement), "max_tokens": record["args"]["max_tokens"],
                    "_source": f"bench/spec_decode.py, {record['when']}, {record['machine']}"}}
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    path.write_text(json.dumps({**stored, **values}, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[3, 5], help="num_speculative_tokens for ngram")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens for the self-draft")
    ap.add_argument("--draft-layers", type=int, default=8, help="the first-layers self-draft (0: leave it out)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU-time columns count all work)")
    ap.add_argument("--only", nargs="+", help="only the configurations whose name holds one of these words "
                    "(saved in bench/out/partial)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per workload")
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts at batch 1 (run one by one)")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens, batch 1 only (saved in bench/out/partial)")
    ap.add_argument("--under-load", action="store_true", help="16 and 64 requests, n-gram k=3 and the automatic "
                    "k's against off and a second engine with speculation off, in rounds (spec_decode_load.json)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every engine in turn (--under-load)")
    ap.add_argument("--steady-prompts", type=int, default=2, help="--under-load's steady rows: prompts per request "
                    "kept in flight (0: one batch only)")
    ap.add_argument("--lesson-from", metavar="JSON", help="only write lesson 6's numbers from a saved result "
                    "(bench/out/spec_decode.json), measuring the self-draft's agreement")
    args = ap.parse_args()
    if args.lesson_from:
        write_lesson_values(json.loads(Path(args.lesson_from).read_text()), args.model)
        return
    if args.quick:
        args.prompts, args.batch1_prompts, args.max_tokens, args.batches = 4, 4, 64, [1]
    if args.under_load:
        if args.only or args.quick:
            ap.error("--under-load runs its own configurations and batches: leave out --only and --quick")
        under_load(args)
        return
    torch.set_num_threads(args.threads)
    configs = {name: spec for name, spec in configurations(args).items()
               if args.only is None or name == "off" or any(word in name for word in args.only)}
    engines = warmed_engines(args.model, configs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results, rows = [], []
    for workload, prompts in workloads(engines["off"]).items():
        for batch in args.batches:
            count = args.batch1_prompts if batch == 1 else max(args.prompts, batch)
            chosen = [prompts[i % len(prompts)] for i in range(count)]     # a batch of 64 repeats the 16 prompts
            runs = {name: run(engine, chosen, batch, params) for name, engine in engines.items()}
            base = runs["off"]
            for name, r in runs.items():
                identical = r["tokens"] == base["tokens"]
                verify_ratio = (r["verify_forward_ms"] / base["decode_forward_ms"]
                                if r["verify_forward_ms"] and base["decode_forward_ms"] else None)
                record = {"workload": workload, "batch": batch, "config": name, "identical": identical,
                          "speedup": base["wall_s"] / r["wall_s"], "cpu_speedup": base["cpu_s"] / r["cpu_s"],
                          "verify_vs_decode": verify_ratio, **{k: v for k, v in r.items() if k != "tokens"}}
                results.append(record)
                rows.append([workload, batch, name, "-" if r["acceptance_rate"] is None else
                             f"{r['acceptance_rate']:.0%}",
                             "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
                             f"{r['tokens_per_forward']:.2f}", f"{r['output_tokens'] / r['wall_s']:.1f}",
                             f"{record['speedup']:.2f}x", f"{record['cpu_speedup']:.2f}x",
                             "-" if verify_ratio is None else f"{verify_ratio:.2f}x",
                             f"{r['draft_ms_per_step']:.2f}", f"{r['host_ms_per_step']:.2f}",
                             "yes" if identical else "NO"])
                print(rows[-1], flush=True)
    markdown = (f"Speculative decoding, {args.model}, greedy, max_tokens={args.max_tokens}, n-grams 2-4, "
                f"{args.prompts} prompts per workload ({args.batch1_prompts} at batch 1), {args.threads} torch "
                f"thread(s); CPU columns: the engine thread's CPU time ({machine_line()})\n\n"
                + table(["workload", "batch", "speculation", "acceptance", "mean accept. length",
                         "tokens / target forward", "output tok/s", "wall speed-up", "CPU speed-up",
                         "verify step / decode step (CPU)", "drafting ms/step (CPU)", "host ms/step (CPU)",
                         "greedy identical"], rows))
    # (a quick or partial run is kept apart, in bench/out/partial/: the docs and lesson 6 render from the full one)
    partial = args.quick or args.only
    save("spec_decode_quick" if args.quick else "spec_decode_partial" if args.only else "spec_decode",
         {"args": vars(args), "results": results}, markdown, out=OUT / "partial" if partial else OUT)
    if not partial:
        write_lesson_values(json.loads((OUT / "spec_decode.json").read_text()), args.model)


CONTROL = "off (a second engine)"
ITSELF = " (its speculator out)"


def run_as(engines: dict[str, Engine], name: str, prompts: list[str], batch: int, params: SamplingParams,
           steady: bool) -> dict:
    """``run`` on the engine of that name; "<name> (its speculator out)": on that engine with speculation off
    for the run (no request is in flight between runs, so nothing waits for a verification). Every run starts
    with an empty prefix cache: an engine that runs twice a round would otherwise find its second run's prompts
    already computed."""
    engine = engines[name.removesuffix(ITSELF)]
    engine.reset_prefix_cache()
    speculator = engine.speculator
    if name.endswith(ITSELF):
        engine.speculator = None
    try:
        return run(engine, prompts, batch, params, steady)
    finally:
        engine.speculator = speculator


def under_load(args: argparse.Namespace) -> None:
    """16 and 64 requests: every engine in turn, ``args.rounds`` times; the median CPU speed-up and its range. The
    engines live through the whole run, as a server's would: the automatic k's estimates and step costs carry over
    from round to round, batch to batch and workload to workload (the first round of all is the only cold one)."""
    torch.set_num_threads(args.threads)
    every = configurations(args)
    shown = [f"ngram k={min(args.ngram_k)}", f"ngram auto k<={max(args.ngram_k)}", f"int8 self-draft auto k<={args.k}"]
    configs = {"off": None, CONTROL: None, **{name: every[name] for name in shown}}   # (the baseline: both off)
    engines = warmed_engines(args.model, configs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    results = []
    loads = [("one batch", 1)] + ([("steady", args.steady_prompts)] if args.steady_prompts else [])
    for engine in engines.values():     # a round not counted: an engine's first full run is a quarter slower
        run(engine, next(iter(workloads(engine).values()))[:16], 16, params)
    for workload, prompts in workloads(engines["off"]).items():
        for batch, (load, per_request) in itertools.product((16, 64), loads):
            chosen = [prompts[i % len(prompts)] for i in range(max(args.prompts, batch) * per_request)]
            rounds = []
            # Each automatic k's engine also runs with its speculator taken out: two engines of one configuration
            # can differ by a percent or two, run after run (where their weights and caches lie in memory), so
            # the fairest baseline of an engine is itself.
            runs = list(engines) + [f"{name}{ITSELF}" for name in shown if "auto" in name]
            for i in range(args.rounds):        # each round in another order: a drift in the CPU's speed hits all
                order = runs[i % len(runs):] + runs[:i % len(runs)]
                rounds.append({name: run_as(engines, name, chosen, batch, params, steady=load == "steady")
                               for name in order})
            # The baseline of a round: both engines with speculation off, averaged (either alone is one sample
            # of the noise; each of the two then reads a little over or under 1.00x)
            base_cpu = [(r["off"]["cpu_s"] + r[CONTROL]["cpu_s"]) / 2 for r in rounds]
            base_wall = [(r["off"]["wall_s"] + r[CONTROL]["wall_s"]) / 2 for r in rounds]
            for name in engines:
                cpu = sorted(b / r[name]["cpu_s"] for b, r in zip(base_cpu, rounds))
                wall = sorted(b / r[name]["wall_s"] for b, r in zip(base_wall, rounds))
                produced = sum(r[name]["output_tokens"] for r in rounds)
                forwards = sum(r[name]["output_tokens"] / r[name]["tokens_per_forward"] for r in rounds)
                record = {"workload": workload, "batch": batch, "load": load, "prompts": len(chosen),
                          "config": name, "rounds": args.rounds,
                          "cpu_speedup": cpu[len(cpu) // 2], "cpu_speedup_min": cpu[0], "cpu_speedup_max": cpu[-1],
                          "speedup": wall[len(wall) // 2], "tokens_per_forward": produced / forwards,
                          "identical": all(r[name]["tokens"] == r["off"]["tokens"] for r in rounds),
                          "cpu_s_rounds": [r[name]["cpu_s"] for r in rounds],
                          "host_ms_per_step": statistics.median(r[name]["host_ms_per_step"] for r in rounds),
                          "draft_ms_per_step": statistics.median(r[name]["draft_ms_per_step"] for r in rounds)}
                if f"{name}{ITSELF}" in rounds[0]:
                    own = sorted(r[f"{name}{ITSELF}"]["cpu_s"] / r[name]["cpu_s"] for r in rounds)
                    record.update(cpu_speedup_itself=own[len(own) // 2], cpu_speedup_itself_min=own[0],
                                  cpu_speedup_itself_max=own[-1],
                                  identical_itself=all(r[f"{name}{ITSELF}"]["tokens"] == r["off"]["tokens"]
                                                       for r in rounds))
                results.append(record)
                print(workload, batch, load, name,
                      f"CPU {record['cpu_speedup']:.3f}x ({cpu[0]:.3f}-{cpu[-1]:.3f})", flush=True)
    markdown = (f"Speculative decoding under load, {args.model}, greedy, max_tokens={args.max_tokens}, "
                f"{args.rounds} rounds ({machine_line()})\n\n" + spec_decode_load_table({"results": results}))
    save("spec_decode_load", {"args": vars(args), "results": results}, markdown)


if __name__ == "__main__":
    main()
