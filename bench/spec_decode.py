"""Speculative decoding on the embedded SmolLM2: off vs n-gram vs self-draft, at batch 1, 4, 16 and 64.

Two workloads, as the seed guide's "When to use" suggests comparing:
  * input-grounded: the answer quotes its input (repeat / correct / edit a passage), where prompt lookup
    finds long matches;
  * open-ended: questions whose answers the prompt does not contain.

For each configuration it reports, in one run: acceptance rate (accepted / drafted), mean acceptance
length (tokens per verification: accepted + the target's own), tokens per target forward pass (all
generated tokens / request-forwards that produced tokens), wall time and the speed-up over speculation
off, and whether greedy outputs were identical (they must be).

    python bench/spec_decode.py [--model smollm2] [--max-tokens 96] [--batches 1 4 16 64] [--ngram-k 3 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from minipaged.bench.report import BENCH_OUT as OUT
from minipaged.bench.report import machine_line, save
from minipaged.bench.report import markdown_table as table
from minipaged import Engine, SamplingParams
from minipaged.workloads import INSTRUCTIONS, OPEN_ENDED, PASSAGES

def workloads(engine: Engine) -> dict[str, list[str]]:
    grounded = [INSTRUCTIONS[i % 2].format(PASSAGES[i % len(PASSAGES)]) for i in range(16)]
    chat = engine.inputs.chat_prompt
    return {"input-grounded": [chat([{"role": "user", "content": p}]) for p in grounded],
            "open-ended": [chat([{"role": "user", "content": p}]) for p in OPEN_ENDED]}


def run(engine: Engine, prompts: list[str], batch: int, params: SamplingParams) -> dict:
    """Generate every prompt, ``batch`` at a time; the engine's counters say what speculation did."""
    events = []
    unsubscribe = engine.subscribe(events.append)
    before = dict(engine.counters)
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += engine.generate(prompts[i:i + batch], params, use_tqdm=False)
    wall = time.perf_counter() - start
    unsubscribe()
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
    return {"wall_s": wall, "tokens": [o.token_ids for o in outs], "output_tokens": produced,
            "acceptance_by_position": [round(k / o, 4) for k, o in zip(kept, offered)],
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / verifications if verifications else None,
            "tokens_per_forward": produced / forwards if forwards else 0.0, "steps": len(events)}


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
        config = "selfdraft" if r["config"].startswith("self-draft") else r["config"].replace(" ", "_").replace("=", "")
        key = f"{workload}_b{r['batch']}_{config}"
        values[f"{key}_speedup"] = round(r["speedup"], 2)
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
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per workload")
    ap.add_argument("--batch1-prompts", type=int, default=8, help="prompts at batch 1 (run one by one)")
    ap.add_argument("--quick", action="store_true", help="4 prompts, 64 tokens, batch 1 only")
    ap.add_argument("--lesson-from", metavar="JSON", help="only write lesson 6's numbers from a saved result "
                    "(bench/out/spec_decode.json), measuring the self-draft's agreement")
    args = ap.parse_args()
    if args.lesson_from:
        write_lesson_values(json.loads(Path(args.lesson_from).read_text()), args.model)
        return
    if args.quick:
        args.prompts, args.batch1_prompts, args.max_tokens, args.batches = 4, 4, 64, [1]
    configs: dict[str, object] = {"off": None}
    for k in args.ngram_k:
        configs[f"ngram k={k}"] = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4}
    configs[f"self-draft {args.draft_layers}L k={args.k}"] = {
        "method": "draft_model", "model": "self", "num_draft_layers": args.draft_layers,
        "num_speculative_tokens": args.k}
    engines = {name: Engine(args.model, speculative_config=spec) for name, spec in configs.items()}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    for engine in engines.values():                       # warm-up, not measured
        engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    results, rows = [], []
    for workload, prompts in workloads(engines["off"]).items():
        for batch in args.batches:
            count = args.batch1_prompts if batch == 1 else max(args.prompts, batch)
            chosen = [prompts[i % len(prompts)] for i in range(count)]     # a batch of 64 repeats the 16 prompts
            runs = {name: run(engine, chosen, batch, params) for name, engine in engines.items()}
            base = runs["off"]
            for name, r in runs.items():
                identical = r["tokens"] == base["tokens"]
                record = {"workload": workload, "batch": batch, "config": name, "identical": identical,
                          "speedup": base["wall_s"] / r["wall_s"], **{k: v for k, v in r.items() if k != "tokens"}}
                results.append(record)
                rows.append([workload, batch, name, "-" if r["acceptance_rate"] is None else
                             f"{r['acceptance_rate']:.0%}",
                             "-" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}",
                             f"{r['tokens_per_forward']:.2f}", f"{r['output_tokens'] / r['wall_s']:.1f}",
                             f"{record['speedup']:.2f}x", "yes" if identical else "NO"])
                print(rows[-1], flush=True)
    markdown = (f"Speculative decoding, {args.model}, greedy, max_tokens={args.max_tokens}, n-grams 2-4, "
                f"{args.prompts} prompts per workload ({args.batch1_prompts} at batch 1) ({machine_line()})\n\n"
                + table(["workload", "batch", "speculation", "acceptance", "mean accept. length",
                         "tokens / target forward", "output tok/s", "wall speed-up", "greedy identical"], rows))
    save("spec_decode", {"args": vars(args), "results": results}, markdown)
    if not args.quick:
        write_lesson_values(json.loads((OUT / "spec_decode.json").read_text()), args.model)


if __name__ == "__main__":
    main()
