"""One request, in-process, against pinned reference commits: the speed a single user sees, kept from slipping.

Issue 51 found that one request got 13% slower in a round and no check noticed. This bench runs the same
request (SmolLM2, fp32, one thread, greedy, ``--max-tokens`` new tokens) on the working tree and on each
``--reference`` commit (checked out into a temporary git worktree), each in a fresh subprocess, the trees taking
turns round after round (these machines are noisy: only a side-by-side run says anything), and reports each
tree's best decode speed and its ratio to the working tree.

    python bench/one_request.py [--reference 6ca911d 3d5120d] [--rounds 4] [--max-tokens 160] [--threads 1]

Writes bench/out/one_request.json (and .md). A reference tree is imported from its own folders: its
``minipaged`` package, with its ``kernels/``, ``tui/`` and ``lessons/`` mapped in as the installed package maps
them, so the commit's own code runs, compiled kernels included.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from minipaged.bench.report import BENCH_OUT, save
from minipaged.bench.report import markdown_table as table

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

# Run in a fresh interpreter for one tree: import that tree's minipaged (its top-level folders mapped in as
# pyproject's package-dir maps them), load SmolLM2, then time `repeats` generations and print the best.
CHILD = r"""
import json, sys, time
tree, prompt = sys.argv[1], sys.argv[5]
threads, max_tokens, repeats = (int(a) for a in sys.argv[2:5])
sys.path.insert(0, tree)
import minipaged
minipaged.__path__.append(tree)           # minipaged.kernels -> tree/kernels, .tui -> tree/tui, .lessons -> ...
assert minipaged.__file__.startswith(tree), minipaged.__file__
from minipaged import Engine, SamplingParams
engine = Engine("smollm2", num_threads=threads)
import minipaged.kernels
assert minipaged.kernels.__file__.startswith(tree), minipaged.kernels.__file__
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))        # warm-up (compiles, caches)
best = 0.0
for _ in range(repeats):
    start = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    seconds = time.perf_counter() - start
    best = max(best, len(out.token_ids) / seconds)
print(json.dumps({"tok_s": best, "tokens": len(out.token_ids)}))
"""


def run_tree(tree: Path, threads: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(threads), str(max_tokens), str(repeats),
                           PROMPT], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the run on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(commit: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s", commit], capture_output=True,
                          text=True, check=True).stdout.strip()[:90]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--reference", nargs="*", default=["6ca911d"], help="commits to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=4, help="rounds; each runs every tree once, in turn")
    ap.add_argument("--repeats", type=int, default=3, help="generations per run (the best counts)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, Path] = {"working tree": ROOT}
        for commit in args.reference:
            path = Path(tmp) / commit
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                           capture_output=True)
            trees[commit] = path
        try:
            speeds: dict[str, list[float]] = {name: [] for name in trees}
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))     # alternate who goes first
                for name in order:
                    speeds[name].append(run_tree(trees[name], args.threads, args.max_tokens, args.repeats)["tok_s"])
                    print(f"round {r + 1}: {name}: {speeds[name][-1]:.1f} tok/s", flush=True)
        finally:
            for commit in args.reference:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[commit])],
                               capture_output=True)
    ours = max(speeds["working tree"])
    record = {"model": "smollm2", "dtype": "float32", "threads": args.threads, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "repeats": args.repeats,
              "trees": {name: {"tok_s": values, "best": max(values), "median": statistics.median(values),
                               "commit": "working tree" if name == "working tree" else describe(name),
                               "best_over_working_tree": max(values) / ours} for name, values in speeds.items()}}
    rows = [(name, t["commit"], t["best"], t["median"], t["best_over_working_tree"]) for name, t in
            record["trees"].items()]
    md = (f"One request in-process (SmolLM2 fp32, {args.threads} thread, {args.max_tokens} greedy tokens, best of "
          f"{args.repeats} per run, {args.rounds} alternating rounds), tok/s\n\n"
          + table(("tree", "commit", "best", "median", "best / working tree's"), rows, ".2f"))
    save("one_request", record, md)
    print(f"wrote {BENCH_OUT / 'one_request.json'}")


if __name__ == "__main__":
    main()
