#!/usr/bin/env python
"""What the engine around the kernels does to a GPU, measured in one unattended run (`make gpu-check`).

Issue 37's questions, on a TinyLlama-1.1B-shaped checkpoint with random weights (bf16; speed depends on the
shapes, not the values): how much of a decode step the GPU is busy, how many kernels the host launches a step,
how far one request is from the weights' HBM floor, how 256 requests compare with transformers on the same GPU,
and what `minipaged serve` costs against the same engine in-process; each with CUDA graphs off and on.

Stages run in this order (most wanted first), each under its own time limit and all under one budget; the JSON
is rewritten after every stage, so a run cut short still leaves everything it measured:

  checkpoint    the TinyLlama-shaped checkpoint, drawn on the GPU and saved once (minipaged.model.testing)
  engine        the engine on it (the triton backend), its CUDA graphs captured at start-up (time, memory)
  graphs_exact  greedy tokens with graphs replayed against the same engine eager. In bf16 a padded batch may
                round differently (another matmul shape), so this counts agreement; the exact check, in fp32,
                is tests/test_triton_gpu.py (`pytest -m gpu`, run first by `make gpu-check`)
  step_profile  decode steps at batch 1/64/256: wall time, device time (torch profiler: the time kernels ran),
                GPU-busy fraction (device / wall), kernel launches the host issued, kernels the GPU ran; and what
                the steps' events said (host, forward call and device milliseconds: the TUI's busy gauge)
  alone         one request: ms per token against the HBM floor (the weights' bytes / the card's peak)
  throughput    256 requests (prompts of 128-512 random tokens, 256 out): output tokens/s
  hf_generate   the same token ids through transformers' padded `generate` (batches of 64), on the same weights
  serve         `minipaged serve`, 128 streams x 128 tokens, against the same workload in-process (tok/s, TTFT)
  hf_generate_batch   the same ids through transformers' own continuous batching, `generate_batch`
  async         async output processing on and off, where the engine has the option (else recorded as absent)

    python bench/gpu_step.py                  # needs CUDA: bench/out/gpu_step-<card>.{json,md}
    python bench/gpu_step.py --dry-run        # anywhere: the plan and the engine options, nothing run
    python bench/gpu_step.py --smoke-model DIR --device cpu --stages engine step_profile   # wiring, on a CPU
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# Each stage's own limit (seconds); the run's budget caps them all. Measured on nothing yet: a first GPU run
# will tell whether they fit (each stage records its seconds).
STAGE_LIMIT_S = {"checkpoint": 60, "engine": 75, "graphs_exact": 30, "step_profile": 60, "alone": 20,
                 "throughput": 60, "hf_generate": 60, "serve": 100, "hf_generate_batch": 60, "async": 60}
STAGES = tuple(STAGE_LIMIT_S)
MIN_STAGE_S = 5.0               # a stage with less time left than this is skipped, not started

# Peak HBM bandwidth in bytes/s by card name (first match wins); as bench/paged_attention.py's table.
PEAK_BANDWIDTH = [("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H100", 3.35e12),
                  ("A100", 2.0e12)]

# Host-side calls that put work on the GPU, as torch's profiler names them (runtime and driver API spellings;
# Triton launches through the driver). A replayed CUDA graph is one cudaGraphLaunch however many kernels it holds.
LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch"}


def event_times(events: list[Any]) -> dict[str, Optional[float]]:
    """What the steps' own events said (lesson 10's gauge): median host, forward-call and device milliseconds, and
    the device's share of the steps' wall time. The device's time is the CUDA events' span over the forward
    pass, an upper bound on the time kernels ran (kernels/backends/forward_timer.py): beside the profiler's
    ``device_ms`` it shows how tight that bound is. None where an event carries none (a CPU)."""
    def median_ms(name: str) -> Optional[float]:
        values = [getattr(e, name) for e in events if getattr(e, name, None) is not None]
        return statistics.median(values) * 1000 if values else None
    device = [e.device_s for e in events if getattr(e, "device_s", None) is not None]
    wall = sum(e.duration_s for e in events)
    return {"event_host_ms": median_ms("host_s"), "event_forward_ms": median_ms("forward_s"),
            "event_device_ms": median_ms("device_s"),
            "event_device_busy": sum(device) / wall if device and wall else None}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Stages: " + ", ".join(STAGES))
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="which stages to run")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="the whole run's time; each stage gets its own limit or what is left, the smaller")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256], help="decode batch sizes to profile")
    p.add_argument("--profile-steps", type=int, default=5, help="decode steps timed (and profiled) per batch")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=str, default="128-512", help="prompt lengths, LO-HI tokens")
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=64, help="transformers' padded generate: batch size")
    p.add_argument("--alone-tokens", type=int, default=128, help="tokens of the one request alone")
    p.add_argument("--serve-streams", type=int, default=128)
    p.add_argument("--serve-tokens", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="the engine's share (transformers and the server need the rest)")
    p.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "minipaged-tinyllama-shaped-bf16"),
                   help="where the TinyLlama-shaped checkpoint is saved (reused when present)")
    p.add_argument("--smoke-model", default=None,
                   help="use this checkpoint instead (no 'checkpoint' stage): a tiny one checks the wiring")
    p.add_argument("--device", default="cuda", help="cuda; cpu only with --smoke-model (times mean nothing)")
    p.add_argument("--peak-bandwidth", type=float, default=None, help="bytes/s (default: from the card's name)")
    p.add_argument("--out-dir", type=Path, default=None, help="default: bench/out")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the engine options; run nothing")
    args = p.parse_args(argv)
    lo, _, hi = args.input_len.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit() and 0 < int(lo) <= int(hi or lo)):
        p.error(f"--input-len must be LO-HI tokens, e.g. 128-512; got {args.input_len!r}")
    args.input_range = (int(lo), int(hi or lo))
    if args.device != "cuda" and not args.smoke_model and not args.dry_run:
        p.error("--device cpu only checks the wiring: give --smoke-model DIR (a tiny checkpoint) too")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine every stage measures: bf16 on the GPU, room for the longest request, the batch cap the
    workloads need, CUDA graphs captured (each stage turns replays off or on; see graphs_on)."""
    cuda = args.device == "cuda"
    return {"device": args.device, "dtype": "bfloat16" if cuda else "float32",
            "max_model_len": args.input_range[1] + max(args.output_len, args.alone_tokens, args.serve_tokens) + 64,
            "max_num_seqs": max(256, *args.batches, args.serve_streams),
            **({"gpu_memory_utilization": args.gpu_memory_utilization, "cuda_graphs": True} if cuda else
               {"num_blocks": 2048, "block_size": 16})}


class StageTimeout(Exception):
    """A stage ran past its limit (raised by SIGALRM in the main thread)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(_signum: int, _frame: Any) -> None:
        raise StageTimeout(f"over its {seconds:.0f} s limit")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Run:
    """The record of one run, rewritten to disk after each stage; stages run in turn under the budget."""

    def __init__(self, args: argparse.Namespace, card: str) -> None:
        from minipaged.bench.report import BENCH_OUT, machine_line
        self.args = args
        self.out_dir = args.out_dir or BENCH_OUT
        self.name = "gpu_step-" + re.sub(r"[^A-Za-z0-9]+", "_", card).strip("_")
        self.deadline = time.monotonic() + args.budget_s
        self.record: dict[str, Any] = {"bench": "gpu_step", "card": card, "machine": machine_line(),
                                       "when": time.strftime("%Y-%m-%d %H:%M"), "versions": versions(),
                                       "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                       "engine_options": engine_options(args), "stages": {}}

    def stage(self, name: str, fn: Callable[[dict[str, Any]], None]) -> bool:
        """Run ``fn(out)`` under the stage's limit; ``fn`` fills ``out`` as it goes, so that a stage cut short
        by its limit still records the parts it finished. True when it ran to the end."""
        if name not in self.args.stages:
            return False
        left = self.deadline - time.monotonic()
        limit = min(STAGE_LIMIT_S[name], left)
        entry: dict[str, Any] = {"limit_s": round(limit, 1)}
        out: dict[str, Any] = {}
        if limit < MIN_STAGE_S:
            entry["status"] = f"skipped: {left:.0f} s of the budget left"
        else:
            start = time.monotonic()
            try:
                with time_limit(limit):
                    fn(out)
                entry["status"] = "ok"
            except StageTimeout as e:
                entry["status"] = f"timeout: {e}"
            except Exception as e:                        # a stage's failure is recorded; the next stage runs
                entry.update(status=f"error: {type(e).__name__}: {e}"[:500],
                             traceback=traceback.format_exc()[-2000:])
            entry["seconds"] = round(time.monotonic() - start, 2)
        self.record["stages"][name] = {**entry, **out}
        print(f"[gpu_step] {name}: {entry['status']} ({entry.get('seconds', 0):.1f} s)", flush=True)
        self.save()
        return entry["status"] == "ok"

    def save(self) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.name}.json"
        path.write_text(json.dumps(self.record, indent=2, default=str))
        (self.out_dir / f"{self.name}.md").write_text(summary_markdown(self.record) + "\n")
        return path


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:                                    # not installed (Triton on a Mac): say so
            out[name] = "absent"
    return out


def lookup_peak(card: str) -> Optional[float]:
    return next((peak for key, peak in PEAK_BANDWIDTH if key.lower() in card.lower()), None)


# ------------------------------------------------------------------------------------------------------------
# Measuring
# ------------------------------------------------------------------------------------------------------------
class Bench:
    """The stages' shared state: the engine (one, reused: its graphs are switched off and on, not rebuilt),
    the prompts, and what earlier stages measured that later ones compare against."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        self.torch = torch
        self.args = args
        self.cuda = args.device == "cuda"
        self.folder: Optional[str] = args.smoke_model
        self.engine: Any = None
        self.graphs: Any = None
        self.throughput: dict[str, float] = {}
        self.prompts = self.random_prompts(args.num_requests, *args.input_range, seed=0)

    def random_prompts(self, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
        from minipaged.bench.requests import random_token_prompts
        vocab = 32000 if self.args.smoke_model is None else 256
        return random_token_prompts(n, lo, hi, seed, vocab=vocab)

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    @contextmanager
    def graphs_on(self, on: bool) -> Iterator[None]:
        """Replays on or off for the engine's captured graphs (off is exactly the eager engine: the runner
        checks ``graphs`` first thing and runs the model itself when it has none)."""
        with nullcontext() if on else self.engine.runner.eager():
            yield

    def settings(self) -> list[tuple[str, bool]]:
        return [("graphs_off", False)] + ([("graphs_on", True)] if self.graphs is not None else [])

    # -- stages ---------------------------------------------------------------------------------------------
    def checkpoint(self, out: dict[str, Any]) -> None:
        from minipaged.model.testing import TINYLLAMA_SHAPE, build_tinyllama_shaped
        existed = (Path(self.args.folder) / "config.json").exists()
        self.folder = str(build_tinyllama_shaped(self.args.folder, device="cuda", dtype=self.torch.bfloat16))
        out.update(folder=self.folder, reused=existed, shape=TINYLLAMA_SHAPE)

    def start_engine(self, out: dict[str, Any]) -> None:
        from minipaged import Engine
        if self.folder is None:
            raise RuntimeError("no checkpoint: the 'checkpoint' stage did not run or failed")
        lines: list[str] = []
        start = time.perf_counter()
        self.engine = Engine(self.folder, load_progress=lines.append, **engine_options(self.args))
        self.graphs = self.engine.runner.graphs
        out.update(startup_s=time.perf_counter() - start, startup_lines=lines,
                   backend=self.engine.backend.describe(), weight_bytes=self.engine.model.weight_bytes(),
                   num_blocks=self.engine.info.num_blocks,
                   graph_sizes=self.graphs.sizes if self.graphs is not None else None,
                   capture=next((line for line in lines if line.startswith("CUDA graphs")), None))

    def graphs_exact(self, out: dict[str, Any]) -> None:
        from minipaged import SamplingParams
        if self.graphs is None:
            out["note"] = "no CUDA graphs on this device"
            return
        prompts = self.random_prompts(24, 16, 96, seed=1)
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        with self.graphs_on(False):
            eager = [o.token_ids for o in self.engine.generate(prompts, params, use_tqdm=False)]
        replays = self.graphs.replays
        with self.graphs_on(True):
            graphed = [o.token_ids for o in self.engine.generate(prompts, params, use_tqdm=False)]
        out.update(requests=len(prompts), identical_requests=sum(a == b for a, b in zip(eager, graphed)),
                   identical_tokens=sum(x == y for a, b in zip(eager, graphed) for x, y in zip(a, b)),
                   tokens=sum(len(a) for a in eager), replays=self.graphs.replays - replays)

    def step_profile(self, out: dict[str, Any]) -> None:
        for name, on in self.settings():
            with self.graphs_on(on):
                for batch in self.args.batches:
                    out.setdefault(name, {})[str(batch)] = self.profile_decode(batch)

    def profile_decode(self, batch: int) -> dict[str, Any]:
        """``batch`` requests decoding together: time ``profile_steps`` steps plain, then the same number under
        torch's profiler (device time, launches, kernels)."""
        from minipaged import SamplingParams
        engine, steps = self.engine, self.args.profile_steps
        params = SamplingParams(temperature=0, max_tokens=engine.config.max_model_len - 64, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in self.random_prompts(batch, 32, 32, seed=batch)]
        try:
            for _ in range(200):                           # prefill everyone, until a step is all decodes
                event = engine.step().event
                if len(event.scheduled) == batch and all(s.kind == "decode" for s in event.scheduled):
                    break
            for _ in range(3):                             # warm-up (a graph's first replay, allocator)
                engine.step()
            self.sync()
            start = time.perf_counter()
            events = [engine.step().event for _ in range(steps)]
            self.sync()
            wall_ms = (time.perf_counter() - start) / steps * 1000
            profiled = self.profiled_steps(steps)
        finally:
            for rid in ids:
                engine.abort(rid)
        busy = profiled["device_ms"] / profiled["wall_ms"] if profiled["wall_ms"] else None
        return {"wall_ms": wall_ms, **profiled, "gpu_busy": busy,
                "gpu_busy_unprofiled_wall": profiled["device_ms"] / wall_ms if wall_ms else None,
                **event_times(events)}

    def profiled_steps(self, steps: int) -> dict[str, Any]:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                self.engine.step()
            self.sync()
            wall = time.perf_counter() - start
        device_us, kernels, launches = 0.0, 0, 0
        for event in prof.events():
            if event.device_type == DeviceType.CUDA:
                device_us += event.time_range.elapsed_us()
                kernels += 1
            elif event.name in LAUNCH_CALLS:
                launches += 1
        return {"wall_ms": wall / steps * 1000, "device_ms": device_us / steps / 1000,
                "kernels_per_step": kernels / steps, "launches_per_step": launches / steps}

    def alone(self, out: dict[str, Any]) -> None:
        from minipaged import SamplingParams
        peak = self.args.peak_bandwidth or (lookup_peak(self.torch.cuda.get_device_name()) if self.cuda else None)
        floor_ms = self.engine.model.weight_bytes() / peak * 1000 if peak else None
        out.update(hbm_floor_ms=floor_ms, peak_bandwidth=peak)
        prompt = self.random_prompts(1, 32, 32, seed=2)
        for name, on in self.settings():
            events: list[Any] = []
            with self.graphs_on(on):
                unsubscribe = self.engine.subscribe(events.append)
                try:
                    self.engine.generate(prompt, SamplingParams(temperature=0, max_tokens=self.args.alone_tokens,
                                                                ignore_eos=True), use_tqdm=False)
                finally:
                    unsubscribe()
            decodes = [e.duration_s for e in events if e.scheduled and all(s.kind == "decode" for s in e.scheduled)]
            ms = statistics.median(decodes) * 1000
            out[name] = {"ms_per_token": ms, "x_floor": ms / floor_ms if floor_ms else None}

    def run_throughput(self, out: dict[str, Any]) -> None:
        from minipaged import SamplingParams
        params = SamplingParams(temperature=0, max_tokens=self.args.output_len, ignore_eos=True)
        out.update(requests=len(self.prompts), output_len=self.args.output_len)
        for name, on in self.settings():
            with self.graphs_on(on):
                self.engine.generate(self.prompts[:4], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
                self.engine.reset_prefix_cache()
                start = time.perf_counter()
                outs = self.engine.generate(self.prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in outs)
            self.throughput[name] = tokens / seconds
            out[name] = {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds}

    def hf_generate(self, out: dict[str, Any]) -> None:
        from minipaged.bench.baseline import hf_padded_generate
        hf = self.engine.loaded.hf_model                 # transformers' model, on the engine's weights (shared)
        pad = self.engine.tokenizer.pad_token_id
        hf_padded_generate(hf, self.prompts[:2], [4, 4], 2, pad_id=pad)            # warm-up
        seconds, useful = hf_padded_generate(hf, self.prompts, [self.args.output_len] * len(self.prompts),
                                             self.args.hf_batch_size, pad_id=pad)
        out.update(batch_size=self.args.hf_batch_size, **self.against_minipaged(seconds, useful))

    def hf_generate_batch(self, out: dict[str, Any]) -> None:
        from transformers import GenerationConfig
        hf = self.engine.loaded.hf_model
        config = GenerationConfig(max_new_tokens=self.args.output_len, do_sample=False,
                                  pad_token_id=self.engine.tokenizer.pad_token_id, eos_token_id=None)
        start = time.perf_counter()
        results = hf.generate_batch(inputs=self.prompts, generation_config=config, progress_bar=False)
        seconds = time.perf_counter() - start
        out.update(self.against_minipaged(seconds, sum(len(r.generated_tokens) for r in results.values())))

    def against_minipaged(self, seconds: float, tokens: int) -> dict[str, Any]:
        """A baseline's rate, and minipaged's best rate on the same requests (the throughput stage) over it."""
        best = max(self.throughput.values(), default=None)
        return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
                "minipaged_x": best / (tokens / seconds) if best else None}

    def serve(self, out: dict[str, Any]) -> None:
        from minipaged import SamplingParams
        from minipaged.bench.servers import free_port, minipaged_serve_command, running
        from minipaged.options import as_command_line
        prompts = self.random_prompts(self.args.serve_streams, *self.args.input_range, seed=3)
        tokens = self.args.serve_tokens
        options = {**engine_options(self.args), "num_blocks": self.engine.info.num_blocks}
        options.pop("gpu_memory_utilization", None)          # num_blocks says it: the same pool as in-process
        out.update(streams=len(prompts), tokens=tokens)
        for name, on in self.settings():
            with self.graphs_on(on):
                start = time.perf_counter()
                outs = self.engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens,
                                                                    ignore_eos=True), use_tqdm=False)
                seconds = time.perf_counter() - start
            local = {"tok_s": sum(len(o.token_ids) for o in outs) / seconds,
                     "median_ttft_ms": statistics.median(o.metrics.ttft for o in outs) * 1000}
            flags = as_command_line({**options, "cuda_graphs": on} if self.cuda else options)
            port = free_port()
            log = str(Path(self.args.out_dir or tempfile.gettempdir()) / f"gpu_step-serve-{name}.log")
            with running(minipaged_serve_command(self.folder, port, flags), port, what="minipaged serve",
                         log_path=log, timeout_s=60) as url:
                served = asyncio.run(stream_all(url, self.folder, prompts, tokens))
            out[name] = {"in_process": local, "served": served,
                         "served_over_in_process": served["tok_s"] / local["tok_s"],
                         "ttft_ratio": served["median_ttft_ms"] / local["median_ttft_ms"]}

    def async_output_processing(self, out: dict[str, Any]) -> None:
        from minipaged.config import EngineConfig
        if "async_output_processing" not in EngineConfig.__dataclass_fields__:
            out["note"] = "this build has no async_output_processing option"
            return
        from minipaged import Engine, SamplingParams
        params = SamplingParams(temperature=0, max_tokens=self.args.output_len, ignore_eos=True)
        prompts = self.prompts[:64]
        out["requests"] = len(prompts)
        self.engine = self.graphs = None                    # one engine on the GPU at a time
        if self.cuda:
            self.torch.cuda.empty_cache()
        for setting in (False, True):
            engine = Engine(self.folder, async_output_processing=setting, **engine_options(self.args))
            start = time.perf_counter()
            outs = engine.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            out["on" if setting else "off"] = {"output_tok_s": sum(len(o.token_ids) for o in outs) / seconds}
            engine.close()
            del engine


async def stream_all(url: str, model: str, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Every prompt as its own streamed completion, all at once: tokens/s and the median TTFT."""
    import httpx

    from minipaged.bench.serve import send
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None)) as client:
        def body(prompt: list[int], n: int) -> dict[str, Any]:
            return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
        await send(client, url, "completions", body(prompts[0], 2), len(prompts[0]))        # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*[send(client, url, "completions", body(p, tokens), len(p)) for p in prompts])
        seconds = time.perf_counter() - start
    done = [r for r in results if r.error is None]
    return {"tok_s": sum(r.output_tokens for r in done) / seconds, "failed": len(results) - len(done),
            "median_ttft_ms": statistics.median(r.ttft_s for r in done) * 1000 if done else None}


# ------------------------------------------------------------------------------------------------------------
# Reporting
# ------------------------------------------------------------------------------------------------------------
def summary_markdown(record: dict[str, Any]) -> str:
    """The run's headline figures as a table (what exists of them: a stage that failed shows its status)."""
    stages = record["stages"]
    lines = [f"# gpu_step on {record['card']} ({record['when']})", "", "| stage | status | seconds |",
             "|---|---|---|"]
    lines += [f"| {name} | {s['status'].splitlines()[0][:80]} | {s.get('seconds', '')} |" for name, s in stages.items()]
    profile = stages.get("step_profile", {})
    rows = [(setting, batch, r) for setting, by_batch in profile.items() if isinstance(by_batch, dict)
            for batch, r in by_batch.items() if isinstance(r, dict) and "wall_ms" in r]
    if rows:
        lines += ["", "| setting | batch | wall ms/step | device ms/step | GPU busy | launches/step | kernels/step |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {s} | {b} | {r['wall_ms']:.2f} | {r['device_ms']:.2f} | "
                  f"{(r['gpu_busy'] or 0) * 100:.0f}% | {r['launches_per_step']:.0f} | {r['kernels_per_step']:.0f} |"
                  for s, b, r in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        plan = {"stages": [{"name": s, "limit_s": STAGE_LIMIT_S[s]} for s in args.stages],
                "budget_s": args.budget_s, "engine_options": engine_options(args)}
        print(json.dumps(plan, indent=2))
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / "gpu_step-dry_run.json").write_text(json.dumps({"dry_run": True, **plan}, indent=2))
        return 0
    # `timeout` (make gpu-check) ends a run with SIGTERM: exit through Python, so that a running server is stopped
    # and the JSON of the finished stages stays as written.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: sys.exit(143))
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device here (torch.cuda.is_available() is False); --dry-run shows the plan.",
              file=sys.stderr)
        return 1
    card = torch.cuda.get_device_name() if args.device == "cuda" else f"{args.device}-smoke"
    run, bench = Run(args, card), Bench(args)
    if args.smoke_model is None:
        run.stage("checkpoint", bench.checkpoint)
    run.stage("engine", bench.start_engine)
    if bench.engine is not None:
        run.stage("graphs_exact", bench.graphs_exact)
        run.stage("step_profile", bench.step_profile)
        run.stage("alone", bench.alone)
        run.stage("throughput", bench.run_throughput)
        run.stage("hf_generate", bench.hf_generate)
        run.stage("serve", bench.serve)
        run.stage("hf_generate_batch", bench.hf_generate_batch)
        run.stage("async", bench.async_output_processing)
    path = run.save()
    print(summary_markdown(run.record))
    print(f"\n(saved {path} and .md)")
    failed = [name for name, s in run.record["stages"].items() if s["status"] != "ok"]
    return 1 if failed and "engine" in failed else 0


if __name__ == "__main__":
    sys.exit(main())
