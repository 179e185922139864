"""Where one request's decode step goes, in-process and through ``minipaged serve`` (issue 51: one request got
slower and nobody could say on what).

The same request as ``bench/one_request.py`` (SmolLM2, fp32, one thread, greedy, ``--max-tokens`` tokens,
``ignore_eos``), on the working tree only:

- in-process: ``Engine.generate``, each step split by wrapping the engine's own parts (``host_overhead``'s
  ``PartClock``; a wrapper costs microseconds, a profiler would cost more than the host work it measures):
  the compiled layer loop (``Backend.decode_layers``: 30 layers in one C call), the LM head (``Backend.lm_head``),
  the rest of the forward pass (embedding, final norm, attention planning, and the prompt's prefill, which runs
  the layers in Python), and the host's part of the step
  (the step less the model's ``execute``: scheduling, inputs, sampling, detokenising, deltas, the event);
- serve: one streamed request alone, as ``one_request.py`` sends it, with the CPU time each process spent on it
  (``/proc/PID/stat``: the API server's and the engine core's, all their threads) per token beside the wall
  time per token, so that the server's per-token cost is measured, not guessed.

    python bench/one_request_profile.py [--max-tokens 320] [--repeats 3]

Writes bench/out/one_request_profile.json (and .md).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Any


from minipaged import Engine, SamplingParams
from minipaged.bench.docs import one_request_profile_table
from minipaged.bench.one_request import PROMPT, SERVED_NAME, stream_one
from minipaged.bench.part_clock import PartClock
from minipaged.bench.report import save
from minipaged.bench.servers import free_port, minipaged_serve_command, running

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def in_process(threads: int, max_tokens: int, repeats: int) -> dict[str, Any]:
    """ms per decode step, by part, in wall time and in the engine thread's CPU time (what a loaded machine does
    not stretch): the median over ``repeats`` generations of each part's mean per step; shares are of CPU time."""
    engine = Engine("smollm2", num_threads=threads)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))        # warm-up
    clock, backend = PartClock(), engine.runner.backend
    undo = [clock.wrap(engine, "step", "step"), clock.wrap(engine.runner, "execute", "execute"),
            clock.wrap(backend, "decode_layers", "layers"), clock.wrap(backend, "lm_head", "lm_head")]
    per_step: dict[str, dict[str, list[float]]] = {}
    tok_s = []
    try:
        for _ in range(repeats):
            clock.reset()
            start = time.perf_counter()
            out = engine.generate([PROMPT], params)[0]
            tok_s.append(len(out.token_ids) / (time.perf_counter() - start))
            steps = len(out.token_ids)          # one prefill step, then a step per token after the first
            for kind, spent in (("ms_per_step", clock.wall), ("cpu_ms_per_step", clock.cpu)):
                parts = {"step": spent["step"], "layers": spent["layers"], "lm_head": spent["lm_head"],
                         "forward_rest": spent["execute"] - spent["layers"] - spent["lm_head"],
                         "host": spent["step"] - spent["execute"]}
                for part, seconds in parts.items():
                    per_step.setdefault(kind, {}).setdefault(part, []).append(1000 * seconds / steps)
    finally:
        for u in undo:
            u()
    shapes = {"vocab_size": engine.inputs.vocab_size, "hidden_size": engine.runner.model.embed.shape[1]}
    engine.close()
    medians = {kind: {part: statistics.median(v) for part, v in parts.items()} for kind, parts in per_step.items()}
    cpu = medians["cpu_ms_per_step"]
    return {**shapes, "tok_s": max(tok_s), **medians, "share": {p: v / cpu["step"] for p, v in cpu.items()}}


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, all its threads (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def core_pid(server_pid: int) -> int:
    """The engine core: the server's child running minipaged.serve.core_process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    command = f.read()
            except OSError:
                continue
            if parent == server_pid and b"core_process" in command:
                return int(entry)
    raise RuntimeError("the engine core's process was not found")


def through_serve(threads: int, max_tokens: int, repeats: int, log_path: Path) -> dict[str, Any]:
    """ms of wall time and of each process's CPU time per token, for the fastest of ``repeats`` requests."""
    port = free_port()
    command = minipaged_serve_command("smollm2", port, ["--threads", str(threads), "--served-model-name",
                                                        SERVED_NAME])
    runs = []
    with running(command, port, what="serve", log_path=str(log_path), timeout_s=300) as url:
        server = _pid_listening(port)
        core = core_pid(server)
        stream_one(url, 8)
        for _ in range(repeats):
            before = (cpu_seconds(server), cpu_seconds(core))
            result = stream_one(url, max_tokens)
            after = (cpu_seconds(server), cpu_seconds(core))
            runs.append({"tok_s": result["tok_s"], "wall_ms": 1000 / result["tok_s"],
                         "api_cpu_ms": 1000 * (after[0] - before[0]) / max_tokens,
                         "core_cpu_ms": 1000 * (after[1] - before[1]) / max_tokens})
    return max(runs, key=lambda r: r["tok_s"])


def _pid_listening(port: int) -> int:
    """The server's process: the one holding the socket that listens on ``port`` (we started it, but
    ``running`` keeps its Popen to itself)."""
    inode = None
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if int(cols[1].split(":")[1], 16) == port and cols[3] == "0A":
                inode = cols[9]
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{entry}/fd"):
                if os.readlink(f"/proc/{entry}/fd/{fd}") == f"socket:[{inode}]":
                    return int(entry)
        except OSError:
            continue
    raise RuntimeError(f"no process listens on port {port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    inproc = in_process(args.threads, args.max_tokens, args.repeats)
    gc.collect()
    serve = through_serve(args.threads, args.max_tokens, args.repeats, Path("/tmp") / "one_request_profile.log")
    inproc_ms = 1000 / inproc["tok_s"]
    record = {"model": "smollm2", "dtype": "float32", "threads": args.threads, "max_tokens": args.max_tokens,
              "vocab_size": inproc.pop("vocab_size"), "hidden_size": inproc.pop("hidden_size"),
              "repeats": args.repeats, "in_process": inproc, "serve": serve,
              "serve_wall_over_in_process": serve["wall_ms"] / inproc_ms, "in_process_wall_ms": inproc_ms}
    md = one_request_profile_table(record)
    save("one_request_profile", record, md)


if __name__ == "__main__":
    main()
