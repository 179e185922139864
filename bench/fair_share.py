"""Issue 48's scheduler cases in miniature: one student's stream while another client floods the engine, with
and without fair share by client (``--fair-share``, minipaged/policies/client_share.py).

  * ``burst``: the greedy client sends 16 prompts of exactly the long-prefill threshold (128 tokens) at once;
    none of them is "long", so without fair share they all prefill in one step.
  * ``cached-prefix``: the greedy client's 3,000-token prefix is cached first, then it sends 12 requests of
    120 new tokens after it: each new token attends to the whole prefix, which the token budget does not see.
  * ``samples``: the greedy client asks n=16 samples of a 256-token prompt in a pool too small for them to the
    end, just before the victim arrives; without fair share the newest request, the victim's, is preempted.
  * ``many-samples``: the greedy client asks n=128 samples of a 1,000-token prompt, 16 tokens each: without fair
    share every step decodes all 128 beside the victim's one row, so each of the victim's tokens waits for them.

The victim (another client) is decoding when the flood arrives. For each case and setting this records the
victim's longest pause between two tokens, the greedy client's completion, the engine's total and its steps,
and checks that the greedy tokens are the same. Time is the engine thread's CPU time with torch on one thread
(the machine is shared: wall time says more about the neighbours), wall time beside it.

    python bench/fair_share.py [--model smollm2] [--cases burst,cached-prefix] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from minipaged import Engine, SamplingParams
from minipaged.bench.report import markdown_table, save

VICTIM_PROMPT = "Say hello to the class in one short sentence."
CASES = ("burst", "cached-prefix", "samples", "many-samples")


def token_ids(seed: int, num_tokens: int, vocab_size: int) -> list[int]:
    """Plain token ids (none of the first ones, where special tokens live)."""
    rng = random.Random(seed)
    return [rng.randrange(min(1000, vocab_size // 4), vocab_size) for _ in range(num_tokens)]


@dataclass
class Flood:
    """What the greedy client sends: a prefix it caches first, then its prompts (all at once, each n samples),
    before the victim arrives or once the victim decodes; and the KV pool's size in blocks (None: the default)."""

    prompts: list[list[int]]
    n: int = 1
    prefix: list[int] = field(default_factory=list)
    before_victim: bool = False
    num_blocks: Optional[int] = None
    max_tokens: int = 4


def flood(case: str, args: argparse.Namespace, vocab: int) -> Flood:
    if case == "burst":
        return Flood([token_ids(100 + i, args.threshold, vocab) for i in range(args.burst_prompts)],
                     max_tokens=args.greedy_max_tokens)
    if case == "samples":                   # the victim arrives after it: vLLM's victim, the newest, is the victim
        return Flood([token_ids(3, args.samples_prompt_tokens, vocab)], n=args.samples, before_victim=True,
                     num_blocks=args.samples_blocks, max_tokens=args.samples_max_tokens)
    if case == "many-samples":
        return Flood([token_ids(4, args.many_prompt_tokens, vocab)], n=args.many_samples,
                     max_tokens=args.many_max_tokens)
    prefix = token_ids(1, args.prefix_tokens, vocab)
    return Flood([prefix + token_ids(200 + i, args.new_tokens, vocab) for i in range(args.prefix_requests)],
                 prefix=prefix, max_tokens=args.greedy_max_tokens)


def run(model: str, fair: bool, case: str, args: argparse.Namespace) -> dict[str, Any]:
    engine = Engine(model, fair_share=fair, num_threads=args.threads, long_prefill_token_threshold=args.threshold,
                    num_blocks=flood(case, args, 1000).num_blocks)
    engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)          # warm-up
    sent = flood(case, args, engine.inputs.vocab_size)
    greedy = SamplingParams(n=sent.n, temperature=0.0, ignore_eos=True, max_tokens=sent.max_tokens, client="greedy")
    if sent.prefix:
        engine.generate([sent.prefix], SamplingParams(temperature=0.0, max_tokens=1, client="greedy"),
                        use_tqdm=False)
    greedy_ids = [engine.add_request(p, greedy) for p in sent.prompts] if sent.before_victim else []
    victim_id = engine.add_request(VICTIM_PROMPT, SamplingParams(
        temperature=0.0, ignore_eos=True, max_tokens=args.victim_max_tokens, client="victim"))
    cpu = wall = 0.0
    flood_cpu = flood_wall = 0.0
    flood_step = 0
    victim_times: list[tuple[float, float]] = []         # (cpu, wall) at each of the victim's tokens
    outputs: dict[str, Any] = {}
    greedy_done: Any = None                              # (cpu, wall) after the flood when its last request ended
    steps = 0
    while engine.has_unfinished_requests():
        c, w = time.thread_time(), time.perf_counter()
        result = engine.step()
        cpu, wall = cpu + time.thread_time() - c, wall + time.perf_counter() - w
        steps += 1
        for delta in result.outputs:
            if delta.request_id == victim_id:
                victim_times.extend([(cpu, wall)] * sum(len(s.token_ids) for s in delta.samples))
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
                if greedy_ids and all(i in outputs for i in greedy_ids) and greedy_done is None:
                    greedy_done = (cpu - flood_cpu, wall - flood_wall)
        if victim_times and not greedy_ids:               # the victim is decoding: the flood comes now
            greedy_ids = [engine.add_request(p, greedy) for p in sent.prompts]
            flood_cpu, flood_wall, flood_step = cpu, wall, steps
    gaps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(victim_times, victim_times[1:]) if a[0] >= flood_cpu]
    free = engine.kv.num_free_blocks == engine.kv.num_blocks
    preemptions = sum(engine.scheduler.num_preemptions.values())
    victim_preemptions = outputs[victim_id].metrics.num_preemptions
    engine.close()
    return {"case": case, "fair_share": fair, "victim_max_gap_cpu_s": max(g[0] for g in gaps),
            "victim_max_gap_wall_s": max(g[1] for g in gaps), "victim_done_cpu_s": victim_times[-1][0] - flood_cpu,
            "greedy_done_cpu_s": greedy_done[0], "greedy_done_wall_s": greedy_done[1],
            "steps_after_flood": steps - flood_step, "preemptions": preemptions,
            "victim_preemptions": victim_preemptions, "all_blocks_free": free,
            "tokens": [outputs[i].token_ids for i in [victim_id, *greedy_ids]]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threshold", type=int, default=128, help="long_prefill_token_threshold (the CPU default)")
    ap.add_argument("--burst-prompts", type=int, default=16, help="burst: prompts of --threshold tokens")
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="cached-prefix: the prefix's tokens")
    ap.add_argument("--prefix-requests", type=int, default=12, help="cached-prefix: requests after the prefix")
    ap.add_argument("--new-tokens", type=int, default=120, help="cached-prefix: each request's new tokens")
    ap.add_argument("--samples", type=int, default=16, help="samples: n of the greedy client's one request")
    ap.add_argument("--samples-prompt-tokens", type=int, default=256, help="samples: its prompt's tokens")
    ap.add_argument("--samples-max-tokens", type=int, default=64, help="samples: tokens each sample generates")
    ap.add_argument("--samples-blocks", type=int, default=56,
                    help="samples: the KV pool, in blocks (too small for its samples to the end)")
    ap.add_argument("--many-samples", type=int, default=128, help="many-samples: n of the greedy client's request")
    ap.add_argument("--many-prompt-tokens", type=int, default=1000, help="many-samples: its prompt's tokens")
    ap.add_argument("--many-max-tokens", type=int, default=16, help="many-samples: tokens each sample generates")
    ap.add_argument("--greedy-max-tokens", type=int, default=4, help="burst, cached-prefix: each request's tokens")
    ap.add_argument("--victim-max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    results = []
    for case in args.cases.split(","):
        assert case in CASES, f"--cases takes {', '.join(CASES)}"
        plain, fair = run(args.model, False, case, args), run(args.model, True, case, args)
        fair["same_tokens"] = plain["same_tokens"] = plain.pop("tokens") == fair.pop("tokens")
        assert fair["same_tokens"], f"{case}: fair share changed greedy outputs"
        results += [plain, fair]
    load = {"before": load_before, "after": os.getloadavg()[0]}
    md = (f"### A victim's stream while another client floods the engine, {args.model}, torch on {args.threads} "
          f"thread(s); seconds of the engine thread's CPU time after the flood arrived (wall in brackets; load "
          f"average {load['before']:.1f} before, {load['after']:.1f} after)\n\n"
          + markdown_table(["case", "fair share", "victim: longest pause", "victim: done", "greedy client: done",
                            "steps", "preemptions (the victim's)", "same tokens"],
                           [[r["case"], "on" if r["fair_share"] else "off",
                             f"{r['victim_max_gap_cpu_s']:.2f} ({r['victim_max_gap_wall_s']:.2f})",
                             f"{r['victim_done_cpu_s']:.2f}",
                             f"{r['greedy_done_cpu_s']:.2f} ({r['greedy_done_wall_s']:.2f})",
                             r["steps_after_flood"], f"{r['preemptions']} ({r['victim_preemptions']})",
                             "yes" if r["same_tokens"] else "**no**"] for r in results]))
    save("fair_share", {"args": vars(args), "load_average": load, "results": results}, md)


if __name__ == "__main__":
    main()
