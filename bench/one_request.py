"""One request, in-process and through ``minipaged serve``, against pinned reference commits: the speed a single
user sees, kept from slipping.

Issue 51 found that one request got 13% slower in a round in-process, and about 30% slower through the server,
and no check noticed. This bench runs the same request (SmolLM2, fp32, one thread, greedy, ``--max-tokens`` new
tokens) on the working tree and on each ``--reference`` commit (checked out into a temporary git worktree), each
in a fresh subprocess, the trees taking turns round after round (these machines are noisy: only a side-by-side
run says anything), and reports each tree's best speed and its ratio to the working tree, for each path:

- ``in-process``: ``Engine.generate`` on the prompt, timed around the call;
- ``serve``: the tree's own ``minipaged serve`` (``--threads 1``), one streamed completion alone (OpenAI
  completions, the same text prompt, ``ignore_eos``), timed from sending it to its last event: what a client
  sees, the server's tokenising, hand-off and streaming included. Commits before the engine core's own process
  (6ca911d, 3d5120d) serve from one process; every commit here takes the same serve flags.

    python bench/one_request.py [--reference 6ca911d 3d5120d] [--rounds 4] [--max-tokens 160] [--threads 1]
                                [--paths in-process serve]

Writes bench/out/one_request.json (and .md). A reference tree is imported from its own folders: its
``minipaged`` package, with its ``kernels/``, ``tui/`` and ``lessons/`` mapped in as the installed package maps
them, so the commit's own code runs, compiled kernels included.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from minipaged.bench.docs import one_request_table
from minipaged.bench.one_request import PROMPT, SERVED_NAME, stream_one
from minipaged.bench.report import BENCH_OUT, save
from minipaged.bench.servers import free_port, minipaged_serve_command, running

ROOT = Path(__file__).resolve().parent.parent

# Run in a fresh interpreter for one tree (a reference tree's code imported through SITECUSTOMIZE, below), load
# SmolLM2, then time `repeats` generations and print the best.
CHILD = r"""
import json, sys, time
tree, prompt = sys.argv[1], sys.argv[5]
threads, max_tokens, repeats = (int(a) for a in sys.argv[2:5])
import minipaged
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


# A reference tree's code, in every Python process a run on it starts: the in-process run's interpreter, its
# `minipaged serve` and that server's engine core (`python -m minipaged.serve.core_process`, since 159a45b). A
# folder holding this sitecustomize goes first on PYTHONPATH, so the interpreter runs it at start-up in each of
# them: the tree's minipaged, its top-level folders mapped in as pyproject's package-dir maps them. (Without it
# the core process imported the installed package, the working tree, and a reference's "serve" figure measured
# the working tree's engine.) The working tree runs as installed.
SITECUSTOMIZE = """
import sys
tree = {tree!r}
sys.path.insert(0, tree)
import minipaged
minipaged.__path__.append(tree)           # minipaged.kernels -> tree/kernels, .tui -> tree/tui, .lessons -> ...
assert minipaged.__file__.startswith(tree), minipaged.__file__
"""


def tree_env(tree: Path, folder: Path) -> Optional[dict[str, str]]:
    """The environment that makes every process started with it import ``tree``'s code (None: the working
    tree, as installed); its sitecustomize is written into a folder of ``folder``."""
    if tree == ROOT:
        return None
    startup = folder / f"startup-{tree.name}"
    startup.mkdir(exist_ok=True)
    (startup / "sitecustomize.py").write_text(SITECUSTOMIZE.format(tree=str(tree)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(startup), os.environ.get("PYTHONPATH")]))}


def serve_tree(tree: Path, threads: int, max_tokens: int, repeats: int, log_path: Path) -> dict[str, Any]:
    """The tree's server, warmed up with a short request, then ``repeats`` requests one at a time; the best."""
    port = free_port()
    flags = ["--threads", str(threads), "--served-model-name", SERVED_NAME]
    command = minipaged_serve_command("smollm2", port, flags)
    env = tree_env(tree, log_path.parent)
    with running(command, port, what=f"serve on {tree}", log_path=str(log_path), env=env, timeout_s=300) as url:
        stream_one(url, 8)
        runs = [stream_one(url, max_tokens) for _ in range(repeats)]
    best = max(runs, key=lambda r: r["tok_s"])
    return {"tok_s": best["tok_s"], "ttft_s": best["ttft_s"], "decode_tok_s": best["decode_tok_s"],
            "text": best["text"]}


def run_tree(tree: Path, threads: int, max_tokens: int, repeats: int, folder: Path) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(threads), str(max_tokens), str(repeats),
                           PROMPT], capture_output=True, text=True, timeout=900, env=tree_env(tree, folder))
    if done.returncode != 0:
        raise SystemExit(f"the run on {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(commit: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%h %s", commit], capture_output=True,
                          text=True, check=True).stdout.strip()[:90]


def summary(values: list[float], ours: float) -> dict[str, Any]:
    return {"tok_s": values, "best": max(values), "median": statistics.median(values),
            "best_over_working_tree": max(values) / ours}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--reference", nargs="*", default=["6ca911d"], help="commits to compare the working tree with")
    ap.add_argument("--rounds", type=int, default=4, help="rounds; each runs every tree once, in turn")
    ap.add_argument("--repeats", type=int, default=3, help="generations per run (the best counts)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--paths", nargs="+", choices=["in-process", "serve"], default=["in-process", "serve"],
                    help="how the request is run: Engine.generate, and/or one streamed request through serve")
    args = ap.parse_args()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    loads: list[float] = []          # the machine's 1-minute load average before each run: was it quiet?
    with tempfile.TemporaryDirectory() as tmp:
        trees: dict[str, Path] = {"working tree": ROOT}
        for commit in args.reference:
            path = Path(tmp) / commit
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), commit], check=True,
                           capture_output=True)
            trees[commit] = path
        runs = {name: {p: [] for p in args.paths} for name in trees}
        try:
            for r in range(args.rounds):
                order = list(trees) if r % 2 == 0 else list(reversed(trees))     # alternate who goes first
                for name in order:
                    for path_name in args.paths:
                        loads.append(os.getloadavg()[0])
                        if path_name == "in-process":
                            result = run_tree(trees[name], args.threads, args.max_tokens, args.repeats, Path(tmp))
                        else:
                            result = serve_tree(trees[name], args.threads, args.max_tokens, args.repeats,
                                                Path(tmp) / f"serve-{r}-{name.replace(' ', '_')}.log")
                        runs[name][path_name].append(result)
                        print(f"round {r + 1}: {name}: {path_name}: {result['tok_s']:.1f} tok/s", flush=True)
        finally:
            for commit in args.reference:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[commit])],
                               capture_output=True)
    texts = {r["text"] for tree in runs.values() for r in tree.get("serve", [])}
    record: dict[str, Any] = {"model": "smollm2", "dtype": "float32", "threads": args.threads,
                              "max_tokens": args.max_tokens, "rounds": args.rounds, "repeats": args.repeats,
                              "paths": args.paths, "serve_texts_identical": len(texts) <= 1,
                              "load_average": [min(loads), max(loads)], "cores": os.cpu_count(), "trees": {}}
    for name, by_path in runs.items():
        entry: dict[str, Any] = {"commit": "working tree" if name == "working tree" else describe(name)}
        for path_name, results in by_path.items():
            ours = max(r["tok_s"] for r in runs["working tree"][path_name])
            key = "in_process" if path_name == "in-process" else "serve"
            entry[key] = summary([r["tok_s"] for r in results], ours)
            if key == "serve":
                entry[key]["ttft_s"] = [r["ttft_s"] for r in results]
                entry[key]["decode_tok_s"] = [r["decode_tok_s"] for r in results]
        if "in_process" in entry:            # the keys the docs read since the bench measured in-process alone
            entry.update({k: entry["in_process"][k] for k in ("tok_s", "best", "median", "best_over_working_tree")})
        if "in_process" in entry and "serve" in entry:
            entry["serve_over_in_process"] = entry["serve"]["best"] / entry["in_process"]["best"]
        record["trees"][name] = entry
    save("one_request", record, f"One request (SmolLM2 fp32, {args.threads} thread, {args.max_tokens} greedy "
         f"tokens, best of {args.repeats} per run, {args.rounds} alternating rounds), tok/s\n\n"
         + one_request_table(record))
    print(f"wrote {BENCH_OUT / 'one_request.json'}")


if __name__ == "__main__":
    main()
