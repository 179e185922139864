"""Shared pieces of the benchmarks: workloads, the transformers baseline, result tables.

Every benchmark runs the engine and its baseline in the same process, one after the other, and reports
ratios: absolute times on shared CPU machines are noisy, ratios much less so.
"""
from __future__ import annotations

import json
import os
import platform
import random
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

OUT = Path(__file__).resolve().parent / "out"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minipaged.bench.baseline import hf_padded_generate  # noqa: E402,F401  (one copy, shared with `minipaged bench`)


def machine_line() -> str:
    return (f"{platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads" + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available()
                                                    else ", no GPU"))


def random_token_prompts(n: int, lo: int, hi: int, seed: int, vocab: int = 49152, avoid: Sequence[int] = (0, 1, 2)
                         ) -> list[list[int]]:
    """Token-id prompts of random lengths (text content does not matter for speed; ids avoid specials)."""
    rng = random.Random(seed)
    return [[rng.randrange(len(avoid), vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def save(name: str, record: dict, markdown: str) -> None:
    OUT.mkdir(exist_ok=True)
    record = {"machine": machine_line(), "when": time.strftime("%Y-%m-%d %H:%M"), **record}
    (OUT / f"{name}.json").write_text(json.dumps(record, indent=2))
    (OUT / f"{name}.md").write_text(markdown + "\n")
    print(markdown)
    print(f"\n(saved {OUT / name}.json and .md)")


def table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def fmt(v):
        return f"{v:.3g}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def drive(engine, arrivals: list[tuple[int, list[int], object]]) -> tuple[dict, list, dict]:
    """Step the engine, adding each (step, prompt, params) when its step comes.

    Arrivals are counted in engine steps, so every configuration sees the same arrival pattern.
    Returns the outputs, the events, and for each request its time to first token counted in steps.
    """
    pending = sorted(arrivals, key=lambda a: a[0])
    ids: list[str] = []
    arrived_at: dict[str, int] = {}
    ttft_steps: dict[str, int] = {}
    events = []
    outputs = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, prompt, params = pending.pop(0)
            ids.append(engine.add_request(prompt, params))
            arrived_at[ids[-1]] = step
        event = engine.step()
        events.append(event)
        for rid in event.new_token_ids:
            ttft_steps.setdefault(rid, step + 1 - arrived_at[rid])
        for out in engine.pop_finished():
            outputs[out.request_id] = out
        step += 1
    return {rid: outputs[rid] for rid in ids}, events, ttft_steps


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]
